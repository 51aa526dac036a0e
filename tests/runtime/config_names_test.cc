// ConfigNames: the named values (runtime/config/named_values.h). Each enum's
// one table gives its spellings; reading, writing, the emitted YAML and the
// "one of ..." of every message all come from it.
#include <gtest/gtest.h>

#include <cctype>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "runtime/config/config.h"
#include "tests/runtime/config_errors.h"

namespace xirang {
namespace {

// Every value of E: spelled by its table, read back from that spelling, and
// nothing else reads as it (no case folding, no padding, no numbers).
template <NamedValue E>
void expect_round_trip(const std::vector<std::string>& expected) {
  SCOPED_TRACE(config_names_text<E>());
  const auto names = config_names<E>();
  ASSERT_EQ(names.size(), expected.size());
  std::set<std::string> seen;
  for (size_t i = 0; i < names.size(); ++i) {
    const E v = E(i);
    EXPECT_EQ(config_name(v), expected[i]);
    EXPECT_EQ(parse_config_name<E>(expected[i]), std::optional<E>(v)) << expected[i];
    EXPECT_EQ(parse_named<E>(config_name(v), "k"), v);
    EXPECT_TRUE(seen.insert(expected[i]).second) << "spelled twice: " << expected[i];
    std::string upper = expected[i];
    for (char& ch : upper) ch = char(std::toupper(static_cast<unsigned char>(ch)));
    if (upper != expected[i]) {
      EXPECT_EQ(parse_config_name<E>(upper), std::nullopt) << upper;
    }
    EXPECT_EQ(parse_config_name<E>(expected[i] + " "), std::nullopt);
  }
  EXPECT_EQ(parse_config_name<E>(""), std::nullopt);
  EXPECT_EQ(parse_config_name<E>(std::to_string(names.size() - 1)), std::nullopt);
  std::string list;
  for (const std::string& n : expected) list += (list.empty() ? "" : ", ") + n;
  EXPECT_EQ(config_names_text<E>(), list);
  const std::string msg = expect_config_error([] { parse_named<E>("nope", "a.key"); }, {});
  EXPECT_EQ(msg, "a.key='nope' is not one of " + list);
}

TEST(ConfigNames, EveryNamedValueRoundTripsWithItsSpellings) {
  expect_round_trip<ScheduleKind>({"gpipe", "1f1b", "interleaved", "zb_h1", "zb_h2", "zb_v"});
  expect_round_trip<Precision>({"fp32", "bf16", "fp16"});
  expect_round_trip<Backend>({"cpu", "cuda"});
  expect_round_trip<FaultKind>(
      {"none", "kill", "hang", "fail_transfer", "kill_in_save", "slow_rank", "nan_grad", "io_error"});
  expect_round_trip<BusyPollMode>({"auto", "on", "off"});
  expect_round_trip<SaveErrorPolicy>({"stop", "continue"});
  expect_round_trip<Recompute>({"none", "selective", "full"});
  expect_round_trip<RopeScaling::Type>({"none", "llama3"});
  expect_round_trip<CpSplit>({"head_tail", "contiguous"});
  expect_round_trip<RouterScore>({"softmax", "sigmoid"});
  expect_round_trip<MoeAuxLoss>({"none", "seq", "global"});
  expect_round_trip<CpCommKind>({"all_gather", "ring"});
  // The enums' meanings, not only their positions.
  EXPECT_EQ(config_name(ScheduleKind::ZeroBubbleH1), std::string("zb_h1"));
  EXPECT_EQ(config_name(ScheduleKind::ZeroBubbleH2), std::string("zb_h2"));
  EXPECT_EQ(config_name(ScheduleKind::ZeroBubbleV), std::string("zb_v"));
  EXPECT_EQ(config_name(FaultKind::KillInSave), std::string("kill_in_save"));
  EXPECT_EQ(config_name(SaveErrorPolicy::Continue), std::string("continue"));
  // models/ spells recomputation for its own messages: the same words.
  for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full})
    EXPECT_EQ(std::string(config_name(r)), recompute_name(r));
}

// The typed value a named key holds, as its index in the key's spellings.
const std::map<std::string, std::function<int(const Config&)>>& named_fields() {
  static const std::map<std::string, std::function<int(const Config&)>> fields = {
      {"model.rope_scaling.type", [](const Config& c) { return int(c.model.rope.scaling.type); }},
      {"model.moe.score", [](const Config& c) { return int(c.model.moe.score); }},
      {"model.moe.aux_loss", [](const Config& c) { return int(c.model.moe.aux_loss); }},
      {"model.tie_embeddings",
       [](const Config& c) { return !c.model.tie_embeddings ? 0 : *c.model.tie_embeddings ? 1 : 2; }},
      {"parallel.schedule", [](const Config& c) { return int(c.parallel.schedule); }},
      {"parallel.cp_split", [](const Config& c) { return int(c.parallel.cp_split); }},
      {"parallel.cp_comm", [](const Config& c) { return int(c.parallel.cp_comm); }},
      {"train.recompute", [](const Config& c) { return int(c.train.recompute); }},
      {"precision.dtype", [](const Config& c) { return int(c.precision.dtype); }},
      {"device.backend", [](const Config& c) { return int(c.device.backend); }},
      {"checkpoint.on_error", [](const Config& c) { return int(c.checkpoint.on_error); }},
      {"comm.busy_poll", [](const Config& c) { return int(c.comm.busy_poll); }},
      {"faults.kind", [](const Config& c) { return int(c.faults.kind); }},
  };
  return fields;
}

// Every key of the schema that takes a named value: read from an override
// and from a file, written to the YAML, read back to the same value; a
// wrong spelling lists them all.
TEST(ConfigNames, EveryNamedKeyReadsAndWritesEachSpelling) {
  const std::vector<NamedKey> keys = named_keys();
  std::set<std::string> listed;
  for (const NamedKey& k : keys) {
    SCOPED_TRACE(k.key);
    listed.insert(k.key);
    ASSERT_TRUE(named_fields().count(k.key)) << "a named key this test does not know";
    const auto& value_of = named_fields().at(k.key);
    const size_t dot = k.key.find('.');
    const std::string section = k.key.substr(0, dot), rest = k.key.substr(dot + 1);
    const size_t inner = rest.find('.');
    const std::string leaf = inner == std::string::npos ? rest : rest.substr(inner + 1);
    std::string list;
    for (const std::string& s : k.spellings) list += (list.empty() ? "" : ", ") + s;
    for (size_t i = 0; i < k.spellings.size(); ++i) {
      const std::string& spelling = k.spellings[i];
      SCOPED_TRACE(spelling);
      const Config c = parse_config("", {k.key + "=" + spelling});
      EXPECT_EQ(value_of(c), int(i));
      EXPECT_NE(c.yaml.find(leaf + ": \"" + spelling + "\""), std::string::npos) << c.yaml;
      const Config back = parse_config(c.yaml);
      EXPECT_EQ(value_of(back), int(i));
      EXPECT_EQ(back.yaml, c.yaml);
      // The file's form: section, then the key (nested for a group such as rope_scaling).
      const std::string file =
          inner == std::string::npos
              ? section + ":\n  " + rest + ": " + spelling + "\n"
              : section + ":\n  " + rest.substr(0, inner) + ":\n    " + leaf + ": " + spelling + "\n";
      EXPECT_EQ(value_of(parse_config(file)), int(i)) << file;
    }
    expect_parse_error("", {k.key + "='Nope' is not one of " + list}, {k.key + "=Nope"});
  }
  EXPECT_EQ(listed.size(), named_fields().size()) << "a named key missing from the schema's list";
  // The schema's spellings are the tables' own.
  for (const NamedKey& k : keys) {
    if (k.key == "parallel.schedule") {
      EXPECT_EQ(k.spellings, (std::vector<std::string>{"gpipe", "1f1b", "interleaved", "zb_h1", "zb_h2", "zb_v"}));
    }
  }
}

}  // namespace
}  // namespace xirang
