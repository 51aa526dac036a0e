// runtime/config/config_read.cc: a config from a file or text: the preset
// first, then the file's keys, then the overrides (config.cc's schema), and
// a stored config (a checkpoint's) whose preset a later build may not know.
#include <yaml-cpp/yaml.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>

#include "core/error.h"
#include "models/model.h"
#include "runtime/config/config.h"
#include "runtime/config/config_text.h"

namespace xirang {

namespace {

// model.preset fills every model field before the other keys, wherever it
// is written: the file's value, then the overrides' in order (the last
// wins). Returns whether an override named it: that preset replaces the
// file's whole model section, and only the overrides change it.
bool apply_preset(Config& c, const YAML::Node& root, const std::vector<std::string>& overrides,
                  const std::string& source) {
  std::string name, where;
  if (root.IsMap()) {
    const YAML::Node model = root["model"];
    if (model && model.IsMap() && model["preset"] && model["preset"].IsScalar()) {
      name = model["preset"].Scalar();
      where = where_of(source, model["preset"]);
    }
  }
  constexpr std::string_view kKey = "model.preset=";
  bool from_override = false;
  for (const std::string& item : overrides)
    if (item.starts_with(kKey)) {
      name = item.substr(kKey.size());
      where = str_cat("override '", item, "'");
      from_override = true;
    }
  if (name.empty()) return from_override;
  try {
    c.model = find_model_preset(name).dims;
  } catch (const Error& e) {
    config_fail(str_cat(where, ": ", e.what()));
  }
  return from_override;
}

// A preset belongs to one architecture: model.arch set to another contradicts it.
void check_preset_arch(const ModelDims& m, const std::string& source) {
  if (m.preset.empty()) return;
  const ModelPreset& p = find_model_preset(m.preset);
  if (p.dims.arch != m.arch)
    config_fail(str_cat(source, ": model.preset=", m.preset, " is a model.arch=", p.dims.arch, " model (", p.what,
                        "), but model.arch=", m.arch));
}

Config parse_config_text(const std::string& yaml_text, const std::vector<std::string>& overrides,
                         const std::string& source, bool stored) {
  Config c;
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    if (e.mark.is_null()) config_fail(str_cat(source, ": YAML syntax error: ", e.msg));
    config_fail(str_cat(source, ": YAML syntax error at line ", e.mark.line + 1, ", column ", e.mark.column + 1,
                        ": ", e.msg));
  }
  // A stored config spells out every model key: a preset this build does
  // not know (renamed or dropped since) stays a label.
  std::string label;
  if (stored && root.IsMap() && root["model"] && root["model"].IsMap() && root["model"]["preset"] &&
      root["model"]["preset"].IsScalar()) {
    const std::string name = root["model"]["preset"].Scalar();
    bool known = name.empty();
    try {
      find_model_preset(name);
      known = true;
    } catch (const Error&) {
    }
    if (!known) {
      label = name;
      root["model"].remove("preset");
    }
  }
  const bool preset_overridden = apply_preset(c, root, overrides, source);
  apply_yaml(c, root, source, preset_overridden ? "model" : "");
  for (const std::string& item : overrides) apply_override(c, item);
  if (!label.empty()) c.model.preset = label;
  else check_preset_arch(c.model, source);
  c.source = source;
  c.yaml = emit_yaml(c);
  return c;
}

}  // namespace

Config parse_config(const std::string& yaml_text, const std::vector<std::string>& overrides,
                    const std::string& source) {
  return parse_config_text(yaml_text, overrides, source, false);
}

Config parse_stored_config(const std::string& yaml_text, const std::string& source) {
  return parse_config_text(yaml_text, {}, source, true);
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

}  // namespace xirang
