// runtime/config.cc: YAML -> Config, overrides, and the rules between fields.
//
// One table (schema()) lists every section and key with a pointer to its
// field; parsing, overrides, error messages and the emitted YAML all walk it,
// so a field added to config.h needs one line here and nothing can drift.
//
// Messages carry no "config error:" prefix: tools/ adds error_kind_name() when
// it prints the Error, so the printed line reads "config error: <what()>".
#include "runtime/config/config.h"

#include <yaml-cpp/yaml.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <span>
#include <sstream>
#include <variant>

#include "core/error.h"
#include "runtime/config/model_layout.h"

namespace xirang {
namespace {

// checkpoint.resume: a mode and, for a path, the path itself.
struct ResumeRef {
  ResumeMode* mode;
  std::string* path;
};

using FieldPtr = std::variant<int*, uint64_t*, double*, std::string*, bool*, Precision*, Backend*, FaultKind*, ResumeRef>;

// Each named value's spellings, in enum order.
constexpr const char* kPrecisionNames[] = {"fp32", "bf16", "fp16"};
constexpr const char* kBackendNames[] = {"cpu", "cuda"};
constexpr const char* kFaultNames[] = {"none", "kill", "hang", "fail_transfer", "kill_in_save"};

std::span<const char* const> spellings(const Precision*) { return kPrecisionNames; }
std::span<const char* const> spellings(const Backend*) { return kBackendNames; }
std::span<const char* const> spellings(const FaultKind*) { return kFaultNames; }

template <class T>
constexpr bool is_named_v = std::is_enum_v<T>;

std::string join_names(std::span<const char* const> names) {
  std::string out;
  for (const char* n : names) out += (out.empty() ? "" : ", ") + std::string(n);
  return out;
}

// The text a field holds, as the emitted YAML spells it (named values by name).
template <class E>
const char* spelling(const E* v) {
  return spellings(v)[size_t(*v)];
}
std::string spelling(const ResumeRef& r) {
  switch (*r.mode) {
    case ResumeMode::Auto: return "auto";
    case ResumeMode::None: return "none";
    case ResumeMode::Path: break;
  }
  return *r.path;
}

struct Field {
  const char* key;
  FieldPtr ptr;
};

struct Section {
  const char* name;
  std::vector<Field> fields;
};

// The order here is the order of the emitted YAML.
std::vector<Section> schema(Config& c) {
  ModelConfig& m = c.model;
  ParallelConfig& p = c.parallel;
  TrainConfig& t = c.train;
  return {
      {"model",
       {{"arch", &m.arch}, {"n_layer", &m.n_layer}, {"n_head", &m.n_head}, {"d_model", &m.d_model},
        {"seq_len", &m.seq_len}, {"vocab_size", &m.vocab_size}, {"vocab_multiple", &m.vocab_multiple}}},
      {"parallel",
       {{"dp", &p.dp}, {"tp", &p.tp}, {"pp", &p.pp}, {"zero", &p.zero}, {"bucket_mb", &p.bucket_mb},
        {"overlap_grad_reduce", &p.overlap_grad_reduce}, {"sequence_parallel", &p.sequence_parallel},
        {"schedule", &p.schedule}, {"virtual_stages", &p.virtual_stages}}},
      {"train",
       {{"steps", &t.steps}, {"global_batch", &t.global_batch}, {"micro_batch", &t.micro_batch},
        {"seq_len", &t.seq_len}, {"lr", &t.lr}, {"min_lr_ratio", &t.min_lr_ratio},
        {"warmup_steps", &t.warmup_steps}, {"weight_decay", &t.weight_decay}, {"beta1", &t.beta1},
        {"beta2", &t.beta2}, {"eps", &t.eps}, {"grad_clip", &t.grad_clip}, {"seed", &t.seed},
        {"eval_every", &t.eval_every}, {"eval_batches", &t.eval_batches}, {"stop_after", &t.stop_after}}},
      {"data",
       {{"train", &c.data.train}, {"val", &c.data.val}, {"prefetch", &c.data.prefetch},
        {"prefetch_min", &c.data.prefetch_min}, {"prefetch_max", &c.data.prefetch_max},
        {"loader_threads", &c.data.loader_threads}, {"read_delay_ms", &c.data.read_delay_ms}}},
      {"metrics",
       {{"jsonl", &c.metrics.jsonl}, {"peak_tflops", &c.metrics.peak_tflops},
        {"log_every", &c.metrics.log_every}}},
      {"memory", {{"limit_gb", &c.memory.limit_gb}}},
      {"precision",
       {{"dtype", &c.precision.dtype}, {"loss_scale", &c.precision.loss_scale},
        {"initial_scale", &c.precision.initial_scale}, {"growth_interval", &c.precision.growth_interval},
        {"min_scale", &c.precision.min_scale}, {"hysteresis", &c.precision.hysteresis}}},
      {"device", {{"backend", &c.device.backend}}},
      {"checkpoint",
       {{"dir", &c.checkpoint.dir}, {"every", &c.checkpoint.every}, {"keep", &c.checkpoint.keep},
        {"resume", ResumeRef{&c.checkpoint.resume, &c.checkpoint.resume_path}}, {"async", &c.checkpoint.async}}},
      {"comm",
       {{"timeout_s", &c.comm.timeout_s}, {"latency_us", &c.comm.latency_us},
        {"bandwidth_gbps", &c.comm.bandwidth_gbps}, {"ordered_p2p", &c.comm.ordered_p2p}}},
      {"faults", {{"kind", &c.faults.kind}, {"rank", &c.faults.rank}, {"step", &c.faults.step}}},
  };
}

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
    std::string operator()(Precision* p) const { return "one of " + join_names(spellings(p)); }
    std::string operator()(Backend* p) const { return "one of " + join_names(spellings(p)); }
    std::string operator()(FaultKind* p) const { return "one of " + join_names(spellings(p)); }
    std::string operator()(ResumeRef) const { return "auto, none or a checkpoint path"; }
  } v;
  return std::visit(v, ptr);
}

// A named value: the spelling's index is the enum value.
template <class E>
bool parse_named(std::string_view text, E* out) {
  const auto names = spellings(out);
  for (size_t i = 0; i < names.size(); ++i)
    if (text == names[i]) {
      *out = E(i);
      return true;
    }
  return false;
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
  bool ok = std::visit(
      [&](auto p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, ResumeRef>) {
          return true;  // handled above
        } else if constexpr (std::is_same_v<T, std::string>) {
          *p = text;
          return true;
        } else if constexpr (is_named_v<T>) {
          // Same words as the other rules' messages: key='value' and what it may be.
          if (!parse_named(text, p))
            config_fail(str_cat(where, ": ", dotted, "='", text, "' is not one of ", join_names(spellings(p))));
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
         std::holds_alternative<Precision*>(ptr) || std::holds_alternative<Backend*>(ptr) ||
         std::holds_alternative<FaultKind*>(ptr);
}

const char* node_kind(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Map: return "a mapping";
    case YAML::NodeType::Sequence: return "a sequence";
    case YAML::NodeType::Null: return "no value";
    default: return "a scalar";
  }
}

std::string where_of(const std::string& source, const YAML::Node& n) {
  YAML::Mark mark = n.Mark();
  if (mark.is_null()) return source;
  return str_cat(source, ":", mark.line + 1);
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

void apply_yaml(Config& c, const YAML::Node& root, const std::string& source) {
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
    if (body.IsNull()) continue;  // "metrics:" with nothing under it
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
      const std::string dotted = name + "." + key;
      const std::string where = where_of(source, key_node);
      const Field& f = find_field(sections, name, key, where);
      if (!seen_keys.insert(key).second) config_fail(str_cat(where, ": key '", dotted, "' appears twice"));
      if (value.IsNull() && takes_text(f.ptr)) {
        assign(f, dotted, "", where);  // "val:" or "val: ~" reads as unset
        continue;
      }
      if (!value.IsScalar())
        config_fail(str_cat(where, ": key '", dotted, "' has ", node_kind(value), value.IsNull() ? "" : " as its value",
                            ", expected ", expected_name(f.ptr)));
      assign(f, dotted, value.Scalar(), where);
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
    for (const Field& f : s.fields) {
      out << YAML::Key << f.key << YAML::Value;
      std::visit(
          [&](auto p) {
            using T = std::remove_pointer_t<decltype(p)>;
            // Quoted so that a path spelled "null" or "~" does not read back as unset.
            if constexpr (std::is_same_v<T, ResumeRef> || is_named_v<T>) out << YAML::DoubleQuoted << spelling(p);
            else if constexpr (std::is_same_v<T, double>) out << format_double(*p);
            else if constexpr (std::is_same_v<T, std::string>) out << YAML::DoubleQuoted << *p;
            else out << *p;
          },
          f.ptr);
    }
    out << YAML::EndMap;
  }
  out << YAML::EndMap;
  XR_CHECK(out.good(), "YAML emitter failed: ", out.GetLastError());
  return std::string(out.c_str()) + "\n";
}

}  // namespace

Config parse_config(const std::string& yaml_text, const std::vector<std::string>& overrides,
                    const std::string& source) {
  Config c;
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    if (e.mark.is_null()) config_fail(str_cat(source, ": YAML syntax error: ", e.msg));
    config_fail(str_cat(source, ": YAML syntax error at line ", e.mark.line + 1, ", column ", e.mark.column + 1,
                        ": ", e.msg));
  }
  apply_yaml(c, root, source);
  for (const std::string& item : overrides) apply_override(c, item);
  c.source = source;
  c.yaml = emit_yaml(c);
  return c;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  // ifstream "opens" a directory on Linux and then reads nothing; say what it is.
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    config_fail(str_cat("cannot open config file '", path, "': it is a directory"));
  std::ifstream in(path, std::ios::binary);
  if (!in) config_fail(str_cat("cannot open config file '", path, "': ", std::strerror(errno)));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) config_fail(str_cat("cannot read config file '", path, "': ", std::strerror(errno)));
  return parse_config(text.str(), overrides, path);
}

// ---------------------------------------------------------------------------
// Named values

ScheduleKind parse_schedule(std::string_view name, std::string_view where) {
  if (name == "gpipe") return ScheduleKind::GPipe;
  if (name == "1f1b") return ScheduleKind::OneFOneB;
  if (name == "interleaved") return ScheduleKind::Interleaved;
  fail(ErrorKind::Config, where, "='", name, "' is not a schedule (expected gpipe, 1f1b or interleaved)");
}

const char* config_name(Precision v) { return spelling(&v); }
const char* config_name(Backend v) { return spelling(&v); }
const char* config_name(FaultKind v) { return spelling(&v); }

const char* schedule_name(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::GPipe: return "gpipe";
    case ScheduleKind::OneFOneB: return "1f1b";
    case ScheduleKind::Interleaved: return "interleaved";
  }
  return "?";
}

// ---------------------------------------------------------------------------
// validate()

namespace {

class Validator {
 public:
  explicit Validator(const Config& c) : prefix_(c.source.empty() ? "" : c.source + ": ") {}

  [[noreturn]] void fail_rule(const std::string& msg) const { config_fail(prefix_ + msg); }

  void at_least(const char* key, int64_t v, int64_t min, const char* why = "") const {
    if (v < min) fail_rule(str_cat(key, "=", v, " must be >= ", min, why));
  }
  // Written as !(ok) so that a NaN set from code fails too.
  void positive(const char* key, double v) const {
    if (!(v > 0)) fail_rule(str_cat(key, "=", format_double(v), " must be > 0"));
  }
  void non_negative(const char* key, double v, const char* why = "") const {
    if (!(v >= 0)) fail_rule(str_cat(key, "=", format_double(v), " must be >= 0", why));
  }
  void half_open_unit(const char* key, double v) const {
    if (!(v >= 0 && v < 1)) fail_rule(str_cat(key, "=", format_double(v), " must be in [0, 1)"));
  }
  void divisible(const char* key, int64_t v, const char* by_key, int64_t by) const {
    if (v % by != 0) fail_rule(str_cat(key, "=", v, " is not divisible by ", by_key, "=", by));
  }

  // A split directory is what `xirang data prepare` writes: index.json plus shards.
  void dataset(const char* key, const std::string& dir) const {
    namespace fs = std::filesystem;
    std::error_code ec;
    if (!fs::is_directory(dir, ec))
      fail_rule(str_cat(key, "='", dir, "': no such directory (write one with `xirang data prepare`)"));
    fs::path index = fs::path(dir) / "index.json";
    if (!fs::is_regular_file(index, ec))
      fail_rule(str_cat(key, "='", dir, "': no dataset there (missing ", index.string(), ")"));
  }

 private:
  std::string prefix_;
};

}  // namespace

void validate(Config& c, int world_size) {
  Validator v(c);
  const ModelConfig& m = c.model;
  const TrainConfig& t = c.train;
  ParallelConfig& p = c.parallel;

  if (!model_arch_known(m.arch))
    v.fail_rule(str_cat("model.arch='", m.arch, "' is not supported (supported: ", model_arch_names(), ")"));
  v.at_least("model.n_layer", m.n_layer, 1);
  v.at_least("model.n_head", m.n_head, 1);
  v.at_least("model.d_model", m.d_model, 1);
  v.at_least("model.seq_len", m.seq_len, 1);
  v.at_least("model.vocab_size", m.vocab_size, 1);
  v.at_least("model.vocab_multiple", m.vocab_multiple, 1);
  v.divisible("model.d_model", m.d_model, "model.n_head", m.n_head);

  v.at_least("train.steps", t.steps, 1);
  v.at_least("train.global_batch", t.global_batch, 1);
  v.at_least("train.micro_batch", t.micro_batch, 1);
  v.at_least("train.seq_len", t.seq_len, 0, " (0 means model.seq_len)");
  if (t.seq_len > m.seq_len)
    v.fail_rule(str_cat("train.seq_len=", t.seq_len, " exceeds model.seq_len=", m.seq_len,
                        " (the size of the position table)"));

  // Layout: world = dp x tp x pp, with dp inferred when 0.
  if (world_size < 1) v.fail_rule(str_cat("world size ", world_size, " must be >= 1"));
  v.at_least("parallel.tp", p.tp, 1);
  v.at_least("parallel.pp", p.pp, 1);
  v.at_least("parallel.dp", p.dp, 0, " (0 infers it from the world size)");
  const int64_t model_ranks = int64_t{p.tp} * p.pp;
  if (p.dp == 0) {
    if (world_size % model_ranks != 0)
      v.fail_rule(str_cat("world size ", world_size, " is not divisible by parallel.tp (", p.tp,
                          ") x parallel.pp (", p.pp, ") = ", model_ranks, ", so parallel.dp cannot be inferred"));
    p.dp = static_cast<int>(world_size / model_ranks);
  }
  if (int64_t{p.dp} * model_ranks != world_size)
    v.fail_rule(str_cat("world size ", world_size, " != parallel.dp (", p.dp, ") x parallel.tp (", p.tp,
                        ") x parallel.pp (", p.pp, ")"));

  v.at_least("parallel.virtual_stages", p.virtual_stages, 1);
  const ScheduleKind kind = parse_schedule(p.schedule, str_cat(c.source.empty() ? "" : c.source + ": ", "parallel.schedule"));
  // What the layout must split evenly (heads, vocabulary, layers), stated once for every architecture.
  if (const std::string problem = layout_problem(model_dims(m), parallel_layout(p)); !problem.empty())
    v.fail_rule(problem);
  if (kind != ScheduleKind::Interleaved && p.virtual_stages != 1)
    v.fail_rule(str_cat("parallel.virtual_stages=", p.virtual_stages, " needs parallel.schedule=interleaved (got ",
                        p.schedule, ")"));
  if (kind == ScheduleKind::Interleaved && p.virtual_stages < 2)
    v.fail_rule("parallel.schedule=interleaved needs parallel.virtual_stages >= 2");

  const int64_t per_micro = int64_t{t.micro_batch} * p.dp;
  if (t.global_batch % per_micro != 0)
    v.fail_rule(str_cat("train.global_batch=", t.global_batch, " is not divisible by train.micro_batch (",
                        t.micro_batch, ") x parallel.dp (", p.dp, ")"));
  if (kind == ScheduleKind::Interleaved && (t.global_batch / per_micro) % p.pp != 0)
    v.fail_rule(str_cat("parallel.schedule=interleaved needs the microbatches per step (train.global_batch ",
                        t.global_batch, " / (train.micro_batch ", t.micro_batch, " x parallel.dp ", p.dp, ") = ",
                        t.global_batch / per_micro, ") to be a multiple of parallel.pp=", p.pp));

  v.positive("train.lr", t.lr);
  v.at_least("train.warmup_steps", t.warmup_steps, 0);
  v.non_negative("train.weight_decay", t.weight_decay);
  v.half_open_unit("train.beta1", t.beta1);
  v.half_open_unit("train.beta2", t.beta2);
  v.positive("train.eps", t.eps);
  v.non_negative("train.grad_clip", t.grad_clip, " (0 disables clipping)");
  if (!(t.min_lr_ratio >= 0 && t.min_lr_ratio <= 1))
    v.fail_rule(str_cat("train.min_lr_ratio=", format_double(t.min_lr_ratio), " must be in [0, 1]"));
  v.at_least("train.eval_every", t.eval_every, 0, " (0 disables validation)");
  v.at_least("train.eval_batches", t.eval_batches, 1);
  v.at_least("train.stop_after", t.stop_after, 0, " (0 runs to train.steps)");
  v.non_negative("metrics.peak_tflops", c.metrics.peak_tflops, " (0 measures it at start)");
  v.at_least("metrics.log_every", c.metrics.log_every, 1);
  v.non_negative("memory.limit_gb", c.memory.limit_gb, " (0 is no limit)");
  if (p.zero != 0 && p.zero != 1) v.fail_rule(str_cat("parallel.zero=", p.zero, " must be 0 or 1"));
  v.positive("parallel.bucket_mb", p.bucket_mb);
  if (p.sequence_parallel) {
    const int64_t rows = int64_t{t.micro_batch} * c.seq_len();
    if (rows % p.tp != 0)
      v.fail_rule(str_cat("parallel.sequence_parallel splits the ", rows, " token rows of a microbatch (train.micro_batch ",
                          t.micro_batch, " x seq_len ", c.seq_len(), ") over parallel.tp=", p.tp,
                          ", which does not divide them"));
  }
  v.at_least("data.prefetch_min", c.data.prefetch_min, 1);
  if (c.data.prefetch_max < c.data.prefetch_min)
    v.fail_rule(str_cat("data.prefetch_max=", c.data.prefetch_max, " is below data.prefetch_min=", c.data.prefetch_min));
  v.at_least("data.loader_threads", c.data.loader_threads, 1);
  v.non_negative("data.read_delay_ms", c.data.read_delay_ms);
  v.positive("comm.timeout_s", c.comm.timeout_s);
  v.non_negative("comm.latency_us", c.comm.latency_us);
  v.non_negative("comm.bandwidth_gbps", c.comm.bandwidth_gbps, " (0 is no limit)");
  v.non_negative("precision.loss_scale", c.precision.loss_scale, " (0 is dynamic under fp16, off otherwise)");
  v.positive("precision.initial_scale", c.precision.initial_scale);
  v.at_least("precision.growth_interval", c.precision.growth_interval, 1);
  v.positive("precision.min_scale", c.precision.min_scale);
  v.at_least("precision.hysteresis", c.precision.hysteresis, 1);
  if (c.precision.min_scale > c.precision.initial_scale)
    v.fail_rule(str_cat("precision.min_scale=", c.precision.min_scale, " is above precision.initial_scale=",
                        c.precision.initial_scale));
  v.at_least("checkpoint.every", c.checkpoint.every, 0, " (0 saves only at the end)");
  v.at_least("checkpoint.keep", c.checkpoint.keep, 1);
  if (c.checkpoint.resume == ResumeMode::Path && c.checkpoint.resume_path.empty())
    v.fail_rule("checkpoint.resume is empty: use auto, none, or the path of a checkpoint step directory");
  if (c.faults.kind != FaultKind::None) {
    if (c.faults.rank < 0 || c.faults.rank >= world_size)
      v.fail_rule(str_cat("faults.rank=", c.faults.rank, " is not a rank of this world (0..", world_size - 1, ")"));
    v.at_least("faults.step", c.faults.step, 1);
  }

  // Data last: the checks above need no filesystem.
  if (c.data.train.empty())
    v.fail_rule("data.train is empty: set it to a dataset directory written by `xirang data prepare`");
  v.dataset("data.train", c.data.train);
  if (!c.data.val.empty()) v.dataset("data.val", c.data.val);
  if (t.eval_every > 0 && c.data.val.empty())
    v.fail_rule(str_cat("train.eval_every=", t.eval_every,
                        " needs data.val (a validation split); set data.val or train.eval_every=0"));
}

}  // namespace xirang
