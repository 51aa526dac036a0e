// Sweep specs: YAML in, the expanded list of points out, each with a stable
// id; and a point's config loaded and validated in-process.
#include <yaml-cpp/yaml.h>

#include <charconv>
#include <filesystem>
#include <set>

#include "core/error.h"
#include "analysis/sweep/sweep.h"

namespace xirang::analysis::sweep {

namespace fs = std::filesystem;

namespace {

// Keys the sweep itself owns: a point may not set them.
const std::set<std::string> kOwnedKeys = {"train.steps", "metrics.jsonl"};
const std::set<std::string> kSpecKeys = {"base",     "set",      "axes",          "points", "steps",   "warmup",
                                         "repeats", "repeat_order", "timeout_s", "launcher", "launcher_args", "env",
                                         "priority"};

struct SpecReader {
  std::string where;  // the spec file, for messages

  [[noreturn]] void bad(const std::string& msg) const { fail(ErrorKind::Config, "sweep spec ", where, ": ", msg); }

  std::string line_of(const YAML::Node& n) const {
    return n.Mark().line >= 0 ? str_cat(" (line ", n.Mark().line + 1, ")") : "";
  }

  std::string scalar(const YAML::Node& n, const std::string& key) const {
    if (!n.IsScalar()) bad(str_cat(key, " must be a single value", line_of(n)));
    return n.Scalar();
  }

  int integer(const YAML::Node& n, const std::string& key, int min) const {
    const std::string t = scalar(n, key);
    int v = 0;
    auto r = std::from_chars(t.data(), t.data() + t.size(), v);
    if (r.ec != std::errc() || r.ptr != t.data() + t.size() || v < min)
      bad(str_cat(key, "='", t, "' must be an integer >= ", min, line_of(n)));
    return v;
  }

  double number(const YAML::Node& n, const std::string& key) const {
    const std::string t = scalar(n, key);
    double v = 0;
    auto r = std::from_chars(t.data(), t.data() + t.size(), v);
    if (r.ec != std::errc() || r.ptr != t.data() + t.size() || !(v > 0))
      bad(str_cat(key, "='", t, "' must be a number > 0", line_of(n)));
    return v;
  }

  // A setting's key must name a config key ("section.key") or ranks.
  Setting setting(const std::string& key, const YAML::Node& value) const {
    if (key != "ranks" && key.find('.') == std::string::npos)
      bad(str_cat("'", key, "' is not a config key (section.key) or ranks", line_of(value)));
    if (kOwnedKeys.count(key))
      bad(str_cat(key, " is set by the sweep (use the spec's steps; metrics go to the point's folder)"));
    Setting s{key, scalar(value, key), nullptr};
    s.value = json_value(s.text);
    if (key == "ranks" && !(s.value.is_number_integer() && s.value.get<int>() >= 1))
      bad(str_cat("ranks='", s.text, "' must be an integer >= 1", line_of(value)));
    return s;
  }

  std::vector<Setting> settings(const YAML::Node& map, const std::string& what) const {
    if (!map.IsMap()) bad(str_cat(what, " must be a map of config keys to values", line_of(map)));
    std::vector<Setting> out;
    for (const auto& kv : map) out.push_back(setting(kv.first.as<std::string>(), kv.second));
    return out;
  }

  static Json json_value(const std::string& t) {
    long long i = 0;
    auto ri = std::from_chars(t.data(), t.data() + t.size(), i);
    if (!t.empty() && ri.ec == std::errc() && ri.ptr == t.data() + t.size()) return i;
    double d = 0;
    auto rd = std::from_chars(t.data(), t.data() + t.size(), d);
    if (!t.empty() && rd.ec == std::errc() && rd.ptr == t.data() + t.size()) return d;
    if (t == "true" || t == "false") return t == "true";
    return t;
  }
};

// The cartesian product of the axes, the last axis varying fastest. An
// axis value that is a map sets several keys together (its axis name is
// then only a name): {parallel.schedule: interleaved, parallel.virtual_stages: 2}.
std::vector<std::vector<Setting>> expand_axes(const SpecReader& r, const YAML::Node& axes) {
  if (!axes.IsMap() || axes.size() == 0) r.bad("axes must be a non-empty map of keys to lists of values");
  std::vector<std::vector<std::vector<Setting>>> values;  // axis -> value -> its settings
  for (const auto& kv : axes) {
    const std::string key = kv.first.as<std::string>();
    if (!kv.second.IsSequence() || kv.second.size() == 0)
      r.bad(str_cat("axes.", key, " must be a non-empty list of values", r.line_of(kv.second)));
    std::vector<std::vector<Setting>> axis;
    for (const auto& v : kv.second)
      axis.push_back(v.IsMap() ? r.settings(v, "axes." + key + " value") : std::vector<Setting>{r.setting(key, v)});
    values.push_back(std::move(axis));
  }
  std::vector<std::vector<Setting>> out = {{}};
  for (const auto& axis : values) {
    std::vector<std::vector<Setting>> next;
    for (const auto& prefix : out)
      for (const std::vector<Setting>& s : axis) {
        next.push_back(prefix);
        next.back().insert(next.back().end(), s.begin(), s.end());
      }
    out = std::move(next);
  }
  return out;
}

// "4", "interleaved" -> a file-name-safe token.
std::string sanitize(const std::string& s) {
  std::string out;
  for (char c : s) out += (std::isalnum(static_cast<unsigned char>(c)) || c == '.') ? c : '_';
  return out;
}

// tp2-pp2-schedule_1f1b: the key's last part (the full key when two settings
// share it) and the value; identical settings give identical ids.
std::string make_id(const std::vector<Setting>& settings) {
  std::map<std::string, int> uses;
  auto short_name = [](const std::string& k) { return k.substr(k.rfind('.') + 1); };
  for (const Setting& s : settings) ++uses[short_name(s.key)];
  std::string id;
  for (const Setting& s : settings) {
    const std::string name = uses[short_name(s.key)] > 1 ? sanitize(s.key) : short_name(s.key);
    const std::string v = sanitize(s.text);
    id += (id.empty() ? "" : "-") + name + (!v.empty() && std::isdigit(static_cast<unsigned char>(v[0])) ? "" : "_") + v;
  }
  return id.empty() ? "base" : id;
}

void finish_points(const SpecReader& r, Spec& spec, std::vector<std::vector<Setting>> combos) {
  std::map<std::string, int> seen;
  for (auto& settings : combos) {
    Point p;
    p.index = int(spec.points.size()) + 1;
    p.id = make_id(settings);
    if (auto it = seen.find(p.id); it != seen.end())
      r.bad(str_cat("points ", it->second, " and ", p.index, " have the same settings (id ", p.id, ")"));
    seen[p.id] = p.index;
    for (const Setting& s : spec.set)
      if (s.key != "ranks") p.overrides.push_back(s.key + "=" + s.text);
      else p.ranks = s.value.get<int>();
    for (const Setting& s : settings)
      if (s.key != "ranks") p.overrides.push_back(s.key + "=" + s.text);
      else p.ranks = s.value.get<int>();
    p.settings = std::move(settings);
    spec.points.push_back(std::move(p));
  }
}

void read_run_keys(const SpecReader& r, const YAML::Node& root, Spec& spec) {
  if (root["steps"]) spec.steps = r.integer(root["steps"], "steps", 1);
  if (root["warmup"]) spec.warmup = r.integer(root["warmup"], "warmup", 0);
  if (root["repeats"]) spec.repeats = r.integer(root["repeats"], "repeats", 1);
  if (root["repeat_order"]) {
    const std::string o = r.scalar(root["repeat_order"], "repeat_order");
    if (o != "points" && o != "rounds")
      r.bad(str_cat("repeat_order='", o, "' must be points (each point's repeats in a row) or rounds (every point once, ",
                    "then again)", r.line_of(root["repeat_order"])));
    spec.rounds = o == "rounds";
  }
  if (root["timeout_s"]) spec.timeout_s = r.number(root["timeout_s"], "timeout_s");
  if (root["priority"]) {
    const int v = r.integer(root["priority"], "priority", -20);
    if (v > 19) r.bad(str_cat("priority='", v, "' must be a nice value from -20 to 19", r.line_of(root["priority"])));
    spec.priority = v;
  }
  if (spec.warmup >= spec.steps)
    r.bad(str_cat("warmup=", spec.warmup, " leaves no measured step of steps=", spec.steps));
  if (root["launcher"]) spec.launcher = parse_launcher(r.scalar(root["launcher"], "launcher"), r.where);
  if (const YAML::Node a = root["launcher_args"]) {
    if (!a.IsSequence()) r.bad(str_cat("launcher_args must be a list of words", r.line_of(a)));
    for (const auto& w : a) spec.launcher.args.push_back(r.scalar(w, "launcher_args"));
  }
  if (const YAML::Node e = root["env"]) {
    if (!e.IsMap()) r.bad(str_cat("env must be a map of variable names to values", r.line_of(e)));
    for (const auto& kv : e) spec.env[kv.first.as<std::string>()] = r.scalar(kv.second, "env");
  }
}

}  // namespace

Launcher parse_launcher(const std::string& text, const std::string& where) {
  Launcher l;
  l.text = text;
  if (text == "mpirun") return l;
  if (text == "srun") {
    l.kind = LauncherKind::Srun;
    return l;
  }
  if (text.find("{args}") == std::string::npos)
    fail(ErrorKind::Config, "sweep spec ", where, ": launcher '", text,
         "' is not mpirun, srun or a command template holding {args} (e.g. 'mpiexec -n {ranks} {xirang} {args}')");
  for (size_t at = text.find('{'); at != std::string::npos; at = text.find('{', at + 1)) {
    const std::string name = text.substr(at, text.find('}', at) - at + 1);
    if (name != "{args}" && name != "{ranks}" && name != "{xirang}" && name != "{id}" && name != "{dir}")
      fail(ErrorKind::Config, "sweep spec ", where, ": launcher template names ", name,
           " (known: {ranks} {xirang} {args} {id} {dir})");
  }
  l.kind = LauncherKind::Template;
  return l;
}

Spec load_spec(const std::string& path) {
  SpecReader r{path};
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    r.bad("cannot read the file");
  } catch (const YAML::Exception& e) {
    r.bad(str_cat("not valid YAML: ", e.msg, " (line ", e.mark.line + 1, ")"));
  }
  if (!root.IsMap()) r.bad("expected a map with base, set, axes or points, steps, ...");
  for (const auto& kv : root)
    if (!kSpecKeys.count(kv.first.as<std::string>()))
      r.bad(str_cat("unknown key '", kv.first.as<std::string>(), "'", r.line_of(kv.first),
                    " (known: base, set, axes, points, steps, warmup, repeats, repeat_order, timeout_s, launcher, "
                    "launcher_args, env, priority)"));
  Spec spec;
  spec.path = path;
  if (!root["base"]) r.bad("no base config (base: PATH, relative to the spec file)");
  const fs::path base = r.scalar(root["base"], "base");
  spec.base = (base.is_absolute() ? base : fs::path(path).parent_path() / base).lexically_normal().string();
  if (!fs::is_regular_file(spec.base)) r.bad(str_cat("base config '", spec.base, "' does not exist"));
  if (root["set"]) spec.set = r.settings(root["set"], "set");
  read_run_keys(r, root, spec);
  if (root["axes"] && root["points"]) r.bad("give axes or points, not both");
  std::vector<std::vector<Setting>> combos = {{}};
  if (root["axes"]) combos = expand_axes(r, root["axes"]);
  if (const YAML::Node pts = root["points"]) {
    if (!pts.IsSequence() || pts.size() == 0) r.bad("points must be a non-empty list of maps");
    combos.clear();
    for (const auto& p : pts) combos.push_back(r.settings(p, str_cat("points[", combos.size(), "]")));
  }
  finish_points(r, spec, std::move(combos));
  // Every point's overrides must at least load: a key or type error is the spec's, not the point's.
  for (const Point& p : spec.points) {
    try {
      load_config(spec.base, p.overrides);
    } catch (const Error& e) {
      r.bad(str_cat("point ", p.index, " (", p.id, "): ", e.what()));
    }
  }
  return spec;
}

Prepared prepare(const Spec& spec, const Point& p) {
  Prepared pre;
  pre.config = load_config(spec.base, p.overrides);
  const ParallelConfig& par = pre.config->parallel;
  pre.ranks = p.ranks ? *p.ranks : (par.dp > 0 ? par.dp : 1) * par.cp * par.tp * par.pp;
  try {
    validate(*pre.config, pre.ranks);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Config) throw;
    pre.refused = str_cat("config error: ", e.what());
  }
  return pre;
}

}  // namespace xirang::analysis::sweep
