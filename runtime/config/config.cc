// runtime/config/config.cc: reading a YAML tree and overrides into a
// Config and writing one back, by walking the schema (config_schema.cc:
// every key, its field and the rule its value meets on its own). Presets
// and files are config_read.cc's; the rules between fields are
// validate.cc's; named values' spellings are named_values.h's.
//
// Parsing, overrides, error messages, the emitted YAML and the single-key
// checks all walk the one table, so a field added to config.h needs one row
// there and nothing can drift.
//
// Messages carry no "config error:" prefix: tools/ adds error_kind_name() when
// it prints the Error, so the printed line reads "config error: <what()>".
#include "runtime/config/config.h"

#include <yaml-cpp/yaml.h>

#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <span>
#include <variant>

#include "core/error.h"
#include "runtime/config/config_schema.h"
#include "runtime/config/config_text.h"

namespace xirang {

// The promise is one line per error; a value from a block scalar or a
// multi-line yaml-cpp message must not break it.
[[noreturn]] void config_fail(const std::string& msg) {
  std::string line;
  line.reserve(msg.size());
  for (char ch : msg) {
    if (ch == '\n') line += "\\n";
    else if (ch == '\r') line += "\\r";
    else line += ch;
  }
  fail(ErrorKind::Config, line);
}

// Shortest text that reads back to the same double (to_chars' guarantee), so
// the emitted YAML round-trips exactly and 6e-4 does not print as 0.00059999...
// YAML 1.1 readers (PyYAML) take "6e-04" for a string; "6.0e-04" reads as a float everywhere.
std::string format_double(double v) {
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), v);
  std::string text(buf, res.ptr);
  size_t e = text.find('e');
  if (e != std::string::npos && text.find('.') == std::string::npos) text.insert(e, ".0");
  return text;
}

namespace {

std::string join_keys(const Section& s) {
  std::string out;
  for (const Field& f : s.fields) out += (out.empty() ? "" : ", ") + std::string(f.key);
  return out;
}

std::string join_sections(const std::vector<Section>& sections) {
  std::string out;
  for (const Section& s : sections) out += (out.empty() ? "" : ", ") + std::string(s.name);
  return out;
}

// from_chars rejects a leading '+', which YAML and humans both write.
std::string_view strip_plus(std::string_view text) {
  return (text.size() > 1 && text[0] == '+' && text[1] != '-') ? text.substr(1) : text;
}

template <class T>
bool parse_integer(std::string_view text, T* out) {
  text = strip_plus(text);
  T v{};
  auto res = std::from_chars(text.data(), text.data() + text.size(), v);
  if (res.ec != std::errc() || res.ptr != text.data() + text.size() || text.empty()) return false;
  *out = v;
  return true;
}

bool parse_double(std::string_view text, double* out) {
  text = strip_plus(text);
  double v = 0;
  auto res = std::from_chars(text.data(), text.data() + text.size(), v);
  if (res.ec != std::errc() || res.ptr != text.data() + text.size() || text.empty()) return false;
  if (!std::isfinite(v)) return false;  // .inf / nan never make a sane hyperparameter
  *out = v;
  return true;
}

std::string expected_name(const FieldPtr& ptr) {
  struct {
    std::string operator()(int*) const { return "an integer"; }
    std::string operator()(uint64_t*) const { return "a non-negative integer"; }
    std::string operator()(double*) const { return "a finite number"; }
    std::string operator()(std::string*) const { return "a string"; }
    std::string operator()(bool*) const { return "true or false"; }
    std::string operator()(const NamedRef& r) const { return "one of " + join_config_names(r.names); }
    std::string operator()(TieRef) const { return "one of " + join_config_names(kTieNames); }
    std::string operator()(StepRange*) const { return "a step range A-B with 1 <= A <= B (e.g. 2-4)"; }
    std::string operator()(ResumeRef) const { return "auto, none or a checkpoint path"; }
  } v;
  return std::visit(v, ptr);
}

// Any text is a path but the two words; an empty one is validate()'s to refuse.
void parse_resume(const std::string& text, ResumeRef r) {
  *r.mode = text == "auto" ? ResumeMode::Auto : text == "none" ? ResumeMode::None : ResumeMode::Path;
  *r.path = *r.mode == ResumeMode::Path ? text : "";
}

// Assigns scalar `text` to the field, or fails naming the key, the value and
// the type. `where` is "file:line" or "override 'a.b=c'".
void assign(const Field& f, const std::string& dotted, const std::string& text, const std::string& where) {
  if (const ResumeRef* r = std::get_if<ResumeRef>(&f.ptr)) return parse_resume(text, *r);
  if (StepRange* const* r = std::get_if<StepRange*>(&f.ptr)) {
    const size_t dash = text.find('-');
    const std::string a = text.substr(0, dash), b = dash == std::string::npos ? a : text.substr(dash + 1);
    const auto number = [](const std::string& x) {
      return !x.empty() && x.size() <= 9 && x.find_first_not_of("0123456789") == std::string::npos ? std::stoi(x) : -1;
    };
    const int first = number(a), last = number(b);
    if (first < 1 || last < first)
      config_fail(str_cat(where, ": ", dotted, "='", text, "' is not a step range A-B with 1 <= A <= B (e.g. 2-4)"));
    **r = StepRange{first, last};
    return;
  }
  if (const TieRef* t = std::get_if<TieRef>(&f.ptr)) {
    if (text == kTieNames[0]) **t = std::nullopt;
    else if (text == kTieNames[1] || text == kTieNames[2]) **t = text == kTieNames[1];
    else config_fail(str_cat(where, ": ", dotted, "='", text, "' is not one of ", join_config_names(kTieNames)));
    return;
  }
  // Same words as the other rules' messages: key='value' and what it may be.
  if (const NamedRef* r = std::get_if<NamedRef>(&f.ptr)) {
    if (!r->parse(text))
      config_fail(str_cat(where, ": ", dotted, "='", text, "' is not one of ", join_config_names(r->names)));
    return;
  }
  bool ok = std::visit(
      [&](auto p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<decltype(p), ResumeRef> || std::is_same_v<decltype(p), TieRef> ||
                      std::is_same_v<decltype(p), NamedRef> || std::is_same_v<T, StepRange>) {
          return true;  // handled above
        } else if constexpr (std::is_same_v<T, std::string>) {
          *p = text;
          return true;
        } else if constexpr (std::is_same_v<T, double>) {
          return parse_double(text, p);
        } else if constexpr (std::is_same_v<T, bool>) {
          if (text == "true") *p = true;
          else if (text == "false") *p = false;
          else return false;
          return true;
        } else {
          return parse_integer(text, p);
        }
      },
      f.ptr);
  if (!ok)
    config_fail(str_cat(where, ": key '", dotted, "' has value '", text, "', expected ", expected_name(f.ptr)));
}

// Strings and named values read an empty value as the empty text.
bool takes_text(const FieldPtr& ptr) {
  return std::holds_alternative<std::string*>(ptr) || std::holds_alternative<ResumeRef>(ptr) ||
         std::holds_alternative<NamedRef>(ptr) || std::holds_alternative<TieRef>(ptr) ||
         std::holds_alternative<StepRange*>(ptr);
}

const char* node_kind(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Map: return "a mapping";
    case YAML::NodeType::Sequence: return "a sequence";
    case YAML::NodeType::Null: return "no value";
    default: return "a scalar";
  }
}


// Looks up section.key; fails with the list of what is known.
const Field& find_field(const std::vector<Section>& sections, const std::string& section, const std::string& key,
                        const std::string& where) {
  for (const Section& s : sections) {
    if (section != s.name) continue;
    for (const Field& f : s.fields)
      if (key == f.key) return f;
    config_fail(str_cat(where, ": unknown key '", section, ".", key, "' (known keys in ", section, ": ",
                        join_keys(s), ")"));
  }
  config_fail(str_cat(where, ": unknown section '", section, "' (known sections: ", join_sections(sections), ")"));
}

// Whether the section has keys spelled "group.key".
bool has_group(const Section& s, const std::string& group) {
  for (const Field& f : s.fields)
    if (std::string_view(f.key).starts_with(group + ".")) return true;
  return false;
}

// The prefix before the first '.' of a grouped key ("rope_scaling"), or "".
std::string group_of(const char* key) {
  const std::string_view k(key);
  const size_t dot = k.find('.');
  return dot == std::string_view::npos ? "" : std::string(k.substr(0, dot));
}

void assign_node(const Field& f, const std::string& dotted, const YAML::Node& value, const std::string& where) {
  if (value.IsNull() && takes_text(f.ptr)) {
    assign(f, dotted, "", where);  // "val:" or "val: ~" reads as unset
    return;
  }
  if (!value.IsScalar())
    config_fail(str_cat(where, ": key '", dotted, "' has ", node_kind(value), value.IsNull() ? "" : " as its value",
                        ", expected ", expected_name(f.ptr)));
  assign(f, dotted, value.Scalar(), where);
}





}  // namespace

std::string where_of(const std::string& source, const YAML::Node& n) {
  YAML::Mark mark = n.Mark();
  if (mark.is_null()) return source;
  return str_cat(source, ":", mark.line + 1);
}

// `skip`: a section whose keys are not applied (model, under an override's preset).
void apply_yaml(Config& c, const YAML::Node& root, const std::string& source, const std::string& skip) {
  std::vector<Section> sections = schema(c);
  if (root.IsNull()) return;  // an empty file: every default
  if (!root.IsMap())
    config_fail(str_cat(where_of(source, root), ": the top level must be a mapping of sections (",
                        join_sections(sections), "), got ", node_kind(root)));
  std::set<std::string> seen_sections;
  for (const auto& section_pair : root) {
    const YAML::Node name_node = section_pair.first;
    const YAML::Node body = section_pair.second;
    if (!name_node.IsScalar())
      config_fail(str_cat(where_of(source, name_node), ": a section name must be a plain word, got ",
                          node_kind(name_node)));
    const std::string name = name_node.Scalar();
    // yaml-cpp keeps both copies of a repeated key; silently using one would hide a typo.
    if (!seen_sections.insert(name).second)
      config_fail(str_cat(where_of(source, name_node), ": section '", name, "' appears twice"));
    // Validates the name even when the body is empty or wrong.
    const Section* section = nullptr;
    for (const Section& s : sections)
      if (name == s.name) section = &s;
    if (section == nullptr)
      config_fail(str_cat(where_of(source, name_node), ": unknown section '", name, "' (known sections: ",
                          join_sections(sections), ")"));
    if (body.IsNull() || name == skip) continue;  // "metrics:" with nothing under it
    if (!body.IsMap())
      config_fail(str_cat(where_of(source, body), ": section '", name, "' must be a mapping of keys (",
                          join_keys(*section), "), got ", node_kind(body)));
    std::set<std::string> seen_keys;
    for (const auto& key_pair : body) {
      const YAML::Node key_node = key_pair.first;
      const YAML::Node value = key_pair.second;
      if (!key_node.IsScalar())
        config_fail(str_cat(where_of(source, key_node), ": a key in section '", name,
                            "' must be a plain word, got ", node_kind(key_node)));
      const std::string key = key_node.Scalar();
      const std::string where = where_of(source, key_node);
      if (!seen_keys.insert(key).second) config_fail(str_cat(where, ": key '", name, ".", key, "' appears twice"));
      // A group of keys spelled "group.key" in the schema (model.rope_scaling)
      // is a nested mapping in the YAML, as in a Hugging Face config.json.
      if (value.IsMap() && has_group(*section, key)) {
        std::set<std::string> seen_sub;
        for (const auto& sub : value) {
          if (!sub.first.IsScalar())
            config_fail(str_cat(where_of(source, sub.first), ": a key in '", name, ".", key,
                                "' must be a plain word, got ", node_kind(sub.first)));
          const std::string full = key + "." + sub.first.Scalar();
          const std::string sub_where = where_of(source, sub.first);
          if (!seen_sub.insert(full).second)
            config_fail(str_cat(sub_where, ": key '", name, ".", full, "' appears twice"));
          assign_node(find_field(sections, name, full, sub_where), name + "." + full, sub.second, sub_where);
        }
        continue;
      }
      if (has_group(*section, key))
        config_fail(str_cat(where, ": key '", name, ".", key, "' has ", node_kind(value),
                            ", expected a mapping (e.g. {type: llama3, factor: 8})"));
      assign_node(find_field(sections, name, key, where), name + "." + key, value, where);
    }
  }
}

void apply_override(Config& c, const std::string& item) {
  const std::string where = str_cat("override '", item, "'");
  size_t eq = item.find('=');
  size_t dot = item.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot > eq || dot == 0 || dot + 1 == eq)
    config_fail(str_cat(where, " is malformed: expected section.key=value, e.g. train.steps=20"));
  std::string section = item.substr(0, dot);
  std::string key = item.substr(dot + 1, eq - dot - 1);
  std::vector<Section> sections = schema(c);
  assign(find_field(sections, section, key, where), section + "." + key, item.substr(eq + 1), where);
}

std::string emit_yaml(const Config& config) {
  Config copy = config;  // schema() wants mutable fields; emitting must not touch the caller's
  YAML::Emitter out;
  out << YAML::BeginMap;
  for (const Section& s : schema(copy)) {
    out << YAML::Key << s.name << YAML::Value << YAML::BeginMap;
    std::string open_group;  // grouped keys ("rope_scaling.type") are emitted as a nested mapping
    for (const Field& f : s.fields) {
      const std::string group = group_of(f.key);
      if (group != open_group) {
        if (!open_group.empty()) out << YAML::EndMap;
        if (!group.empty()) out << YAML::Key << group << YAML::Value << YAML::BeginMap;
        open_group = group;
      }
      out << YAML::Key << (group.empty() ? std::string(f.key) : std::string(f.key).substr(group.size() + 1))
          << YAML::Value;
      std::visit(
          [&](auto p) {
            using T = std::remove_pointer_t<decltype(p)>;
            // Quoted so that a path spelled "null" or "~" does not read back as unset.
            if constexpr (std::is_same_v<decltype(p), ResumeRef> || std::is_same_v<decltype(p), TieRef> ||
                          std::is_same_v<decltype(p), NamedRef> || std::is_same_v<T, StepRange>)
              out << YAML::DoubleQuoted << spelling(p);
            else if constexpr (std::is_same_v<T, double>) out << format_double(*p);
            else if constexpr (std::is_same_v<T, std::string>) out << YAML::DoubleQuoted << *p;
            else out << *p;
          },
          f.ptr);
    }
    if (!open_group.empty()) out << YAML::EndMap;
    out << YAML::EndMap;
  }
  out << YAML::EndMap;
  XR_CHECK(out.good(), "YAML emitter failed: ", out.GetLastError());
  return std::string(out.c_str()) + "\n";
}


bool splits_backward(ScheduleKind k) { return k == ScheduleKind::ZeroBubbleH1 || k == ScheduleKind::ZeroBubbleH2 || k == ScheduleKind::ZeroBubbleV;
}

}  // namespace xirang
