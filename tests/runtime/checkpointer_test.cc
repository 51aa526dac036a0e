// The checkpointer over AdamW's state as named tensors: a save writes the
// moments and master weights of the update (checked against a float64
// AdamW), under their own names and at the parameter offsets of their
// segments; a resume writes them back bitwise; an injected save fault hits
// its own step and no other. One rank, CPU, synchronous saves.
#include "runtime/checkpoint/checkpointer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/faults.h"
#include "runtime/step/optimizer.h"
#include "tests/support/temp_dir.h"

namespace xirang {
namespace {

// Random values in +-[0.1, 1): never zero, so a missed or misplaced copy shows.
std::vector<float> random_values(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> mag(0.1f, 1.0f);
  std::vector<float> v(size_t(n), 0.0f);
  for (auto& x : v) x = (rng() & 1 ? 1.0f : -1.0f) * mag(rng);
  return v;
}

Config test_config(const std::string& dir) {
  Config cfg;
  cfg.parallel.dp = 1;  // one rank (validation would infer it from the world)
  cfg.train.steps = 10;
  cfg.train.lr = 1e-2;
  cfg.train.weight_decay = 0.1;
  cfg.train.beta1 = 0.9;
  cfg.train.beta2 = 0.95;
  cfg.train.eps = 1e-8;
  cfg.checkpoint.dir = dir;
  cfg.checkpoint.every = 1;
  cfg.checkpoint.keep = 10;
  cfg.checkpoint.async = false;
  return cfg;
}

// Two parameters in `dtype` with fp32 gradients: w (6, 5), weight decay,
// in two optimizer segments split inside it as ZeRO-1 splits a parameter
// at a bucket boundary; b (7), no decay, one segment. AdamW over them, its
// state carved the way the trainer carves it (measured, then real).
struct Rig {
  Rig(const Config& c, DType dtype, SaveFaults f = {}) : cfg(c), grid(ProcessGrid::single()), opt(c.train) {
    const Shape shapes[2] = {{6, 5}, {7}};
    const char* names[2] = {"w", "b"};
    for (int k = 0; k < 2; ++k) {
      const std::vector<float> init = random_values(shapes[k].numel(), 11 + uint64_t(k));
      value_bytes[k].resize(size_t(shapes[k].numel()) * dtype_size(dtype));
      grad_store[k].assign(size_t(shapes[k].numel()), 0.0f);
      Tensor value(value_bytes[k].data(), shapes[k], dtype);
      for (int64_t i = 0; i < shapes[k].numel(); ++i) {
        if (dtype == DType::BF16) value.data<bf16>()[i] = float_to_bf16(init[size_t(i)]);
        else value.data<float>()[i] = init[size_t(i)];
      }
      for (int64_t i = 0; i < shapes[k].numel(); ++i) initial[k].push_back(value_at(value, i));
      params.push_back({names[k], value, Tensor(grad_store[k].data(), shapes[k], DType::F32), /*decay=*/k == 0,
                        /*layer=*/0, ShardSpec::whole(shapes[k]), false, false, InitRule::normal(0.02)});
    }
    const Parameter &w = params[0], &b = params[1];
    opt.set_segments({{w.value.flat_range(0, 12), w.grad.flat_range(0, 12), true, true, false, 0, 0},
                      {w.value.flat_range(12, 30), w.grad.flat_range(12, 30), true, true, false, 0, 12},
                      {b.value.flat(), b.grad.flat(), false, true, false, 1, 0}});
    Arena measure = Arena::measuring("optimizer state");
    opt.layout_state(measure);
    // Built between the two layouts, as the trainer builds it: it must see the real state.
    ckpt = std::make_unique<::xirang::Checkpointer>(
        cfg, *grid, TrainingState{params, opt.checkpoint_state(), loss_scale}, Device::CPU, f, false);
    state = Arena("optimizer state", measure.used());
    opt.layout_state(state);
    if (opt.has_master()) opt.init_master(KernelContext{});
  }
  // Fills the gradients with step `t`'s random values and takes AdamW's step.
  void step(int t, double lr, double grad_scale) {
    for (int k = 0; k < 2; ++k) {
      const std::vector<float> g = random_values(params[size_t(k)].grad.numel(), 100 * uint64_t(t) + uint64_t(k));
      std::copy(g.begin(), g.end(), grad_store[k].begin());  // in place: the gradients are views of it
    }
    opt.step(KernelContext{}, lr, grad_scale);
  }
  static double value_at(const Tensor& v, int64_t i) {
    return v.dtype() == DType::BF16 ? double(bf16_to_float(v.data<bf16>()[i])) : double(v.data<float>()[i]);
  }
  double value(int k, int64_t i) const { return value_at(params[size_t(k)].value, i); }

  Config cfg;
  std::unique_ptr<ProcessGrid> grid;
  std::vector<char> value_bytes[2];
  std::vector<float> grad_store[2];
  std::vector<double> initial[2];  // the parameters' first values (bf16: as stored), widened
  std::vector<Parameter> params;
  AdamW opt;
  LossScale loss_scale;
  Arena state;
  std::unique_ptr<::xirang::Checkpointer> ckpt;
};

// The float64 AdamW of the rig's steps, per parameter: p, m, v.
struct Reference {
  std::vector<double> p, m, v;
};

std::vector<Reference> reference_update(const Rig& r, const std::vector<std::pair<double, double>>& steps) {
  const TrainConfig& c = r.cfg.train;
  std::vector<Reference> out(2);
  for (int k = 0; k < 2; ++k) {
    const int64_t n = r.params[size_t(k)].value.numel();
    out[size_t(k)].m.assign(size_t(n), 0.0);
    out[size_t(k)].v.assign(size_t(n), 0.0);
    out[size_t(k)].p = r.initial[k];  // bf16: the master starts as the parameter widened
  }
  for (size_t s = 0; s < steps.size(); ++s) {
    const auto [lr, gs] = steps[s];
    const double t = double(s + 1), c1 = 1.0 - std::pow(c.beta1, t), c2 = 1.0 - std::pow(c.beta2, t);
    for (int k = 0; k < 2; ++k) {
      Reference& ref = out[size_t(k)];
      const double wd = k == 0 ? c.weight_decay : 0.0;
      const std::vector<float> g = random_values(int64_t(ref.p.size()), 100 * uint64_t(s + 1) + uint64_t(k));
      for (size_t i = 0; i < ref.p.size(); ++i) {
        const double gi = double(g[i]) * gs;
        ref.m[i] = c.beta1 * ref.m[i] + (1 - c.beta1) * gi;
        ref.v[i] = c.beta2 * ref.v[i] + (1 - c.beta2) * gi * gi;
        ref.p[i] -= lr * ((ref.m[i] / c1) / (std::sqrt(ref.v[i] / c2) + c.eps) + wd * ref.p[i]);
      }
    }
  }
  return out;
}

std::vector<float> read_whole(const CheckpointReader& r, const std::string& group, const Parameter& p) {
  std::vector<float> out(size_t(p.value.numel()), 0.0f);
  r.read(group, p.name, p.shard, Tensor(out.data(), p.value.shape(), DType::F32));
  return out;
}

void expect_close(const std::vector<float>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(double(got[i]), want[i], 2e-6 * std::abs(want[i]) + 1e-12) << what << " element " << i;
}

class Checkpointer : public ::testing::TestWithParam<DType> {};

// After two AdamW steps a save holds m, v (and under 16-bit parameters the
// fp32 masters, else the parameters) of the float64 update, each under its
// own group, every segment at its offset in its parameter, and the update count.
TEST_P(Checkpointer, SavedMomentsAreThoseOfTheUpdate) {
  const std::string dir = testing_util::fresh_test_dir("ckpt");
  Rig rig(test_config(dir), GetParam());
  const std::vector<std::pair<double, double>> steps = {{1e-2, 0.7}, {5e-3, 1.0}};
  for (size_t s = 0; s < steps.size(); ++s) rig.step(int(s + 1), steps[s].first, steps[s].second);
  rig.ckpt->save(2, nullptr);
  const std::vector<Reference> ref = reference_update(rig, steps);

  const CheckpointReader r = CheckpointReader::open(*CheckpointDir(dir).latest());
  EXPECT_EQ(r.step(), 2);
  EXPECT_EQ(r.get_int(0, "optimizer.updates"), 2);
  const bool master = GetParam() == DType::BF16;
  for (int k = 0; k < 2; ++k) {
    const Parameter& p = rig.params[size_t(k)];
    expect_close(read_whole(r, "adam_m", p), ref[size_t(k)].m, "adam_m of " + p.name);
    expect_close(read_whole(r, "adam_v", p), ref[size_t(k)].v, "adam_v of " + p.name);
    EXPECT_EQ(r.has("master", p.name), master) << p.name;
    expect_close(read_whole(r, master ? "master" : "params", p), ref[size_t(k)].p,
                 (master ? "master of " : "params of ") + p.name);
  }
}

// A fresh optimizer resumed from the save holds the saved state bitwise:
// every group's every segment, and the update count.
TEST_P(Checkpointer, ResumeRestoresTheNamedStateBitwise) {
  const std::string dir = testing_util::fresh_test_dir("ckpt");
  Rig saved(test_config(dir), GetParam());
  saved.step(1, 1e-2, 0.7);
  saved.step(2, 5e-3, 1.0);
  saved.step(3, 2e-3, 0.9);
  saved.ckpt->save(3, nullptr);

  Rig fresh(test_config(dir), GetParam());
  EXPECT_EQ(fresh.ckpt->resume(GetParam()), 3);
  EXPECT_EQ(fresh.opt.updates(), 3);
  const OptimizerState &a = saved.opt.checkpoint_state(), &b = fresh.opt.checkpoint_state();
  ASSERT_EQ(a.groups.size(), b.groups.size());
  ASSERT_EQ(a.groups.size(), GetParam() == DType::BF16 ? 3u : 2u);
  for (size_t g = 0; g < a.groups.size(); ++g)
    for (size_t i = 0; i < a.segments(); ++i) {
      const Tensor &x = a.groups[g].slices[i].data, &y = b.groups[g].slices[i].data;
      ASSERT_EQ(x.bytes(), y.bytes());
      EXPECT_EQ(std::memcmp(x.raw(), y.raw(), x.bytes()), 0) << a.groups[g].name << " segment " << i;
    }
  for (int k = 0; k < 2; ++k)
    for (int64_t i = 0; i < saved.params[size_t(k)].value.numel(); ++i)
      ASSERT_EQ(saved.value(k, i), fresh.value(k, i)) << saved.params[size_t(k)].name << " element " << i;
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Checkpointer, ::testing::Values(DType::F32, DType::BF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// io_error fails the save of its own step and no other: under
// checkpoint.on_error=continue the steps before and after it are committed.
TEST(CheckpointerFaults, IoErrorFailsOnlyItsStep) {
  const std::string dir = testing_util::fresh_test_dir("ckpt");
  Config cfg = test_config(dir);
  cfg.checkpoint.on_error = SaveErrorPolicy::Continue;
  SaveFaults faults;
  faults.io_error_step = 2;
  Rig rig(cfg, DType::F32, faults);
  for (int s = 1; s <= 3; ++s) {
    rig.step(s, 1e-2, 1.0);
    rig.ckpt->save(s, nullptr);
  }
  EXPECT_EQ(CheckpointDir(dir).complete_steps(), (std::vector<int64_t>{1, 3}));
}

// faults.* becomes the checkpointer's plain struct on the configured rank
// only, at the configured step.
TEST(CheckpointerFaults, FaultInjectorHandsOverItsSaveFaults) {
  auto grid = ProcessGrid::single();
  FaultConfig f;
  f.kind = FaultKind::IoError;
  f.rank = 0;
  f.step = 4;
  SaveFaults s = FaultInjector(f, *grid, Device::CPU).save_faults();
  EXPECT_EQ(s.io_error_step, 4);
  EXPECT_EQ(s.kill_step, -1);
  EXPECT_TRUE(s.fails(4));
  EXPECT_FALSE(s.fails(3) || s.fails(5) || s.kills(4));
  f.kind = FaultKind::KillInSave;
  s = FaultInjector(f, *grid, Device::CPU).save_faults();
  EXPECT_EQ(s.kill_step, 4);
  EXPECT_EQ(s.io_error_step, -1);
  f.rank = 1;  // another rank's fault
  s = FaultInjector(f, *grid, Device::CPU).save_faults();
  EXPECT_EQ(s.kill_step, -1);
  EXPECT_EQ(s.io_error_step, -1);
}

}  // namespace
}  // namespace xirang
