// runtime/config/config_schema.h: the schema's row types and the table
// itself, internal to runtime/config. config.cc walks the rows to read a
// YAML tree or an override and to write the YAML; config_schema.cc holds
// the table and checks each row's own rule (field_check.h).
//
//   for (const Section& s : schema(c))
//     for (const Field& f : s.fields) ...   // f.key, f.ptr (the field), f.check (its rule)
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "core/error.h"
#include "runtime/config/config.h"
#include "runtime/config/field_check.h"

namespace xirang {

// checkpoint.resume: a mode and, for a path, the path itself.
struct ResumeRef {
  ResumeMode* mode;
  std::string* path;
};

// model.tie_embeddings: auto (unset: the architecture's default), true or false.
using TieRef = std::optional<bool>*;

// A named value's field (named_values.h): the enum behind the pointer is
// read and written as its index in the ConfigNames table, so one
// alternative serves every named value.
struct NamedRef {
  void* field;
  std::span<const char* const> names;
  size_t (*get)(const void* field);
  void (*set)(void* field, size_t index);

  const char* spelling() const { return names[get(field)]; }
  // Whether `text` is a spelling; if so the field takes its value.
  bool parse(std::string_view text) const {
    for (size_t i = 0; i < names.size(); ++i)
      if (text == names[i]) {
        set(field, i);
        return true;
      }
    return false;
  }
};

template <NamedValue E>
NamedRef named_ref(E* p) {
  return NamedRef{p, config_names<E>(), [](const void* f) { return size_t(*static_cast<const E*>(f)); },
                  [](void* f, size_t i) { *static_cast<E*>(f) = E(i); }};
}

using FieldPtr = std::variant<int*, uint64_t*, double*, std::string*, bool*, NamedRef, TieRef, StepRange*, ResumeRef>;

inline constexpr const char* kTieNames[] = {"auto", "true", "false"};

// The text a field holds, as the emitted YAML spells it (named values by name).
inline const char* spelling(const NamedRef& r) { return r.spelling(); }
inline std::string spelling(const StepRange* r) {
  return r->first == r->last ? std::to_string(r->first) : str_cat(r->first, "-", r->last);
}
inline const char* spelling(TieRef t) { return !t->has_value() ? kTieNames[0] : **t ? kTieNames[1] : kTieNames[2]; }
inline std::string spelling(const ResumeRef& r) {
  switch (*r.mode) {
    case ResumeMode::Auto: return "auto";
    case ResumeMode::None: return "none";
    case ResumeMode::Path: break;
  }
  return *r.path;
}

template <class P>
FieldPtr field_ptr(P p) {
  if constexpr (std::is_pointer_v<P> && NamedValue<std::remove_pointer_t<P>>) return named_ref(p);
  else return p;
}

// One schema row: the key, the field, and the rule the value must meet on
// its own (field_check.h; the rules between fields are validate.cc's).
struct Field {
  const char* key;
  FieldPtr ptr;
  FieldCheck check;

  template <class P>
  Field(const char* k, P p, FieldCheck c = {}) : key(k), ptr(field_ptr(p)), check(c) {}
};

struct Section {
  const char* name;
  std::vector<Field> fields;
};

// Every section and key of `c`, each row pointing at c's field. The order
// here is the order of the emitted YAML and of the rows' checks.
std::vector<Section> schema(Config& c);

}  // namespace xirang
