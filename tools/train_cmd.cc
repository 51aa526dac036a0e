// xirang train CONFIG [--set section.key=value ...]
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "runtime/config.h"
#include "runtime/dataset.h"
#include "runtime/trainer.h"
#include "tools/commands.h"

namespace xirang::tools {

int train_command(int argc, char** argv) {
  std::string config_path;
  std::vector<std::string> overrides;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--set") {
      if (i + 1 >= argc) fail(ErrorKind::Usage, "--set needs a value: --set section.key=value");
      overrides.push_back(argv[++i]);
    } else if (a.rfind("--set=", 0) == 0) {
      overrides.push_back(a.substr(6));
    } else if (a == "-h" || a == "--help") {
      std::printf("usage: xirang train CONFIG [--set section.key=value ...]\n");
      return 0;
    } else if (!a.empty() && a[0] == '-') {
      fail(ErrorKind::Usage, "train: unknown option '", a, "' (expected --set section.key=value)");
    } else if (config_path.empty()) {
      config_path = a;
    } else {
      fail(ErrorKind::Usage, "train: more than one config file given ('", config_path, "' and '", a, "')");
    }
  }
  if (config_path.empty()) fail(ErrorKind::Usage, "train: no config file given (usage: xirang train CONFIG [--set k=v ...])");

  Config cfg = load_config(config_path, overrides);
  validate(cfg, 1);
  Trainer trainer(cfg);
  TrainResult r = trainer.run();
  std::printf("trained %d steps: final train loss %.4f\n", cfg.train.steps, r.losses.back());
  if (r.final_val_loss) {
    TokenDataset train = TokenDataset::open(cfg.data.train), val = TokenDataset::open(cfg.data.val);
    std::printf("validation loss %.4f nats/token; a unigram model of the training text scores %.4f\n",
                *r.final_val_loss, unigram_cross_entropy(train, val));
  }
  if (!cfg.metrics.jsonl.empty()) std::printf("metrics: %s\n", cfg.metrics.jsonl.c_str());
  return 0;
}

}  // namespace xirang::tools
