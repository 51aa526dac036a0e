// xirang ckpt inspect PATH
//
// PATH is a checkpoint step directory or a checkpoint root (its newest
// complete step is inspected). Prints the step, the layout it was saved
// from, every tensor entry (group/name, global shape, stored dtype, the
// slice it holds, the rank file), and verifies every checksum; exits 1 when
// an entry is damaged.
#include <cstdio>
#include <filesystem>
#include <string>

#include "core/error.h"
#include "runtime/checkpoint_io.h"
#include "tools/commands.h"

namespace xirang::tools {

namespace {

std::string slice_str(const CheckpointEntry& e) {
  std::string s = e.shard.replicated() ? "whole"
                                       : str_cat("dim ", e.shard.dim, " part ", e.shard.index, "/", e.shard.parts,
                                                 e.shard.blocks > 1 ? str_cat(" (", e.shard.blocks, " blocks)") : "");
  if (e.flat_begin != 0 || e.flat_end != e.local.numel()) s += str_cat(" [", e.flat_begin, ", ", e.flat_end, ")");
  return s;
}

int inspect(const std::string& path) {
  std::string step_dir = path;
  if (!std::filesystem::exists(std::filesystem::path(path) / "meta.json")) {
    auto latest = CheckpointDir(path).latest();
    if (!latest) fail(ErrorKind::Checkpoint, "no complete checkpoint at '", path, "' (no meta.json, no latest)");
    step_dir = *latest;
  }
  CheckpointReader r = CheckpointReader::open(step_dir);
  const CheckpointMeta& m = r.meta();
  std::printf("checkpoint %s\n  step %lld, saved from dp %d x tp %d x pp %d (zero %d, virtual stages %d%s), %zu rank files\n",
              step_dir.c_str(), (long long)m.step, m.layout.dp, m.layout.tp, m.layout.pp, m.layout.zero,
              m.layout.virtual_stages, m.layout.sequence_parallel ? ", sequence parallel" : "", m.rank_files.size());
  for (const CheckpointEntry& e : r.entries())
    std::printf("  %-8s %-28s %-14s %-5s %-26s rank %d\n", e.group.c_str(), e.name.c_str(), e.shard.global.str().c_str(),
                dtype_name(e.dtype), slice_str(e).c_str(), e.rank);
  const auto damaged = r.verify_all();
  for (const std::string& d : damaged) std::printf("DAMAGED: %s\n", d.c_str());
  std::printf("%zu entries, %zu damaged (checksums verified)\n", r.entries().size(), damaged.size());
  return damaged.empty() ? 0 : 1;
}

}  // namespace

int ckpt_command(int argc, char** argv) {
  if (argc < 2) fail(ErrorKind::Usage, "ckpt: expected a verb (usage: xirang ckpt inspect PATH)");
  const std::string verb = argv[1];
  if (verb == "inspect") {
    if (argc != 3) fail(ErrorKind::Usage, "ckpt inspect: expected one PATH (a checkpoint step directory or root)");
    return inspect(argv[2]);
  }
  fail(ErrorKind::Usage, "ckpt: unknown verb '", verb, "' (expected inspect; convert is not built yet)");
}

}  // namespace xirang::tools
