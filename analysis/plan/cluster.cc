#include "analysis/plan/cluster.h"

#include <yaml-cpp/yaml.h>

#include <cstdio>
#include <functional>
#include <map>
#include <sstream>

#include "core/error.h"

namespace xirang::analysis::plan {

double Cluster::matmul_seconds(double flops, double width, bool fp32) const {
  const double peak = (fp32 && peak_tflops_fp32 > 0 ? peak_tflops_fp32 : peak_tflops) * 1e12;
  const double shape = matmul_half_width > 0 ? width / (width + matmul_half_width) : 1.0;
  return flops / (peak * matmul_efficiency * shape);
}

double Cluster::memory_seconds(double bytes) const {
  return bytes / (memory_bandwidth_gbps * 1e9 * memory_efficiency);
}

namespace {

struct Key {
  const char* name;
  bool required;
  std::function<double&(Cluster&)> field;
};

const std::vector<Key>& number_keys() {
  static const std::vector<Key> keys = {
      {"peak_tflops", true, [](Cluster& c) -> double& { return c.peak_tflops; }},
      {"peak_tflops_fp32", false, [](Cluster& c) -> double& { return c.peak_tflops_fp32; }},
      {"memory_gb", true, [](Cluster& c) -> double& { return c.memory_gb; }},
      {"memory_reserved_gb", false, [](Cluster& c) -> double& { return c.memory_reserved_gb; }},
      {"memory_bandwidth_gbps", true, [](Cluster& c) -> double& { return c.memory_bandwidth_gbps; }},
      {"intra_node.bandwidth_gbps", true, [](Cluster& c) -> double& { return c.intra_node.bandwidth_gbps; }},
      {"intra_node.latency_us", true, [](Cluster& c) -> double& { return c.intra_node.latency_us; }},
      {"inter_node.bandwidth_gbps", true, [](Cluster& c) -> double& { return c.inter_node.bandwidth_gbps; }},
      {"inter_node.latency_us", true, [](Cluster& c) -> double& { return c.inter_node.latency_us; }},
      {"efficiency.matmul", true, [](Cluster& c) -> double& { return c.matmul_efficiency; }},
      {"efficiency.matmul_half_width", false, [](Cluster& c) -> double& { return c.matmul_half_width; }},
      {"efficiency.memory", true, [](Cluster& c) -> double& { return c.memory_efficiency; }},
      {"efficiency.op_overhead_us", true, [](Cluster& c) -> double& { return c.op_overhead_us; }},
      {"efficiency.comm_buffer_mb", false, [](Cluster& c) -> double& { return c.comm_buffer_mb; }},
      {"efficiency.rank_skew", false, [](Cluster& c) -> double& { return c.rank_skew; }},
      {"efficiency.backward_factor", false, [](Cluster& c) -> double& { return c.backward_factor; }},
  };
  return keys;
}

YAML::Node lookup(const YAML::Node& root, const std::string& dotted) {
  const size_t dot = dotted.find('.');
  if (dot == std::string::npos) return root[dotted];
  const YAML::Node sec = root[dotted.substr(0, dot)];
  return sec && sec.IsMap() ? sec[dotted.substr(dot + 1)] : YAML::Node();
}

void refuse_unknown(const YAML::Node& root, const std::string& path) {
  std::map<std::string, bool> known = {{"name", true}, {"devices_per_node", true}, {"nodes", true}};
  for (const Key& k : number_keys()) known[k.name] = true;
  for (const auto& kv : root) {
    const std::string top = kv.first.as<std::string>();
    if (kv.second.IsMap()) {
      for (const auto& sub : kv.second)
        if (!known.count(top + "." + sub.first.as<std::string>()))
          fail(ErrorKind::Config, path, ": unknown key '", top, ".", sub.first.as<std::string>(), "'");
    } else if (!known.count(top)) {
      fail(ErrorKind::Config, path, ": unknown key '", top, "'");
    }
  }
}

double read_number(const YAML::Node& n, const std::string& path, const char* key) {
  try {
    return n.as<double>();
  } catch (const YAML::Exception&) {
    fail(ErrorKind::Config, path, ": ", key, " must be a number");
  }
}

}  // namespace

Cluster load_cluster(const std::string& path) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    fail(ErrorKind::Config, "cluster file '", path, "' cannot be read");
  } catch (const YAML::Exception& e) {
    fail(ErrorKind::Config, "cluster file '", path, "': ", e.what());
  }
  if (!root.IsMap()) fail(ErrorKind::Config, "cluster file '", path, "' is not a YAML mapping");
  refuse_unknown(root, path);
  Cluster c;
  c.source = path;
  c.name = root["name"] ? root["name"].as<std::string>() : path;
  if (!root["devices_per_node"])
    fail(ErrorKind::Config, path, ": missing key 'devices_per_node' (devices in one node)");
  c.devices_per_node = int(read_number(root["devices_per_node"], path, "devices_per_node"));
  if (root["nodes"]) c.nodes = int(read_number(root["nodes"], path, "nodes"));
  for (const Key& k : number_keys()) {
    const YAML::Node n = lookup(root, k.name);
    if (!n) {
      if (k.required) fail(ErrorKind::Config, path, ": missing key '", k.name, "' (see docs/performance_model.md)");
      continue;
    }
    k.field(c) = read_number(n, path, k.name);
    if (k.field(c) < 0) fail(ErrorKind::Config, path, ": ", k.name, " must not be negative");
  }
  if (c.devices_per_node < 1 || c.peak_tflops <= 0 || c.memory_gb <= 0 || c.memory_bandwidth_gbps <= 0 ||
      c.intra_node.bandwidth_gbps <= 0 || c.inter_node.bandwidth_gbps <= 0 || c.matmul_efficiency <= 0 ||
      c.memory_efficiency <= 0 || c.backward_factor <= 0)
    fail(ErrorKind::Config, path, ": devices_per_node, peak_tflops, memory_gb, the bandwidths and the efficiencies must be positive");
  return c;
}

std::string cluster_yaml(const Cluster& c, const std::string& comment) {
  std::ostringstream o;
  o.precision(6);
  o << comment << "name: " << c.name << "\ndevices_per_node: " << c.devices_per_node << "\n";
  if (c.nodes > 0) o << "nodes: " << c.nodes << "\n";
  std::string section;
  for (const Key& k : number_keys()) {
    std::string name = k.name;
    const size_t dot = name.find('.');
    const std::string sec = dot == std::string::npos ? "" : name.substr(0, dot);
    if (sec != section && !sec.empty()) o << sec << ":\n";
    section = sec;
    o << (sec.empty() ? "" : "  ") << (dot == std::string::npos ? name : name.substr(dot + 1)) << ": "
      << k.field(const_cast<Cluster&>(c)) << "\n";
  }
  return o.str();
}

}  // namespace xirang::analysis::plan
