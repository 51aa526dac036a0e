// `xirang data`: turns text into token dataset splits and inspects them.
//
//   xirang data prepare --tokenizer gpt2 --out data/fortunes /usr/share/games/fortunes
//   xirang data inspect data/fortunes
//   echo "Hello world" | xirang data encode --tokenizer gpt2     # 15496 995 198
//   echo "15496 995" | xirang data decode --tokenizer gpt2       # Hello world
//
// The format itself lives in runtime/data/dataset.h; this file only decides what a
// document is, which documents are held out for validation, and what to print.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <unistd.h>

#include "core/error.h"
#include "runtime/data/dataset.h"
#include "runtime/data/tokenizer.h"
#include "tools/commands.h"

namespace xirang::tools {
namespace {

namespace fs = std::filesystem;

constexpr const char* kUsage =
    "usage: xirang data prepare --tokenizer bytes|gpt2 --out DIR [--val-fraction F] [--force] [--shard-tokens N]\n"
    "                           [--threads N] INPUT...\n"
    "       xirang data inspect DIR\n"
    "       xirang data encode --tokenizer bytes|gpt2 [--threads N] < TEXT\n"
    "       xirang data decode --tokenizer bytes|gpt2 < IDS\n"
    "\n"
    "prepare  tokenizes INPUT files (a directory means its regular files, sorted, except *.dat and *.u8)\n"
    "         into DIR/train and DIR/val. A file is one document, or, when it has lines holding only\n"
    "         \"%\" (fortune files), one document per entry. A document goes to val with probability F\n"
    "         (default 0.05), decided by a hash of its text. GPT-2 puts <|endoftext|> before each\n"
    "         document. --threads (default: all cores) encodes in parallel; the output is the same.\n"
    "inspect  prints a split's index (or both splits of a prepared DIR), verifies the shard\n"
    "         checksums and decodes the start of the first document.\n"
    "encode   reads text on stdin and prints its token ids on one line, separated by spaces.\n"
    "         Text that spells <|endoftext|> is encoded as text, not as the end-of-text id.\n"
    "decode   reads token ids (separated by any whitespace) on stdin and writes their text.\n";

struct PrepareOptions {
  std::string tokenizer;
  std::string out;
  double val_fraction = 0.05;
  bool force = false;
  int64_t shard_tokens = int64_t(1) << 28;
  int threads = 0;  // 0: one per core
  std::vector<std::string> inputs;
};

double parse_fraction(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  double f = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || !(f >= 0.0 && f < 1.0))
    fail(ErrorKind::Usage, "data prepare: ", flag, " '", v, "' is not a number in [0, 1)");
  return f;
}

int64_t parse_count(const std::string& flag, const std::string& v, const char* verb = "prepare") {
  int64_t n = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (v.empty() || ec != std::errc() || p != v.data() + v.size() || n < 1)
    fail(ErrorKind::Usage, "data ", verb, ": ", flag, " '", v, "' is not a positive integer");
  return n;
}

int default_threads() { return std::max(1, int(std::thread::hardware_concurrency())); }

PrepareOptions parse_prepare(int argc, char** argv) {
  PrepareOptions o;
  bool flags_done = false;
  for (int i = 2; i < argc; ++i) {
    std::string arg = argv[i];
    if (flags_done || arg.size() < 2 || arg.rfind("--", 0) != 0) {
      o.inputs.push_back(arg);
      continue;
    }
    if (arg == "--") {
      flags_done = true;
      continue;
    }
    std::string flag = arg, value;
    bool inline_value = false;
    if (size_t eq = arg.find('='); eq != std::string::npos) {
      flag = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      inline_value = true;
    }
    if (flag == "--force") {
      if (inline_value) fail(ErrorKind::Usage, "data prepare: --force takes no value");
      o.force = true;
      continue;
    }
    if (flag != "--tokenizer" && flag != "--out" && flag != "--val-fraction" && flag != "--shard-tokens" &&
        flag != "--threads")
      fail(ErrorKind::Usage, "data prepare: unknown flag '", flag,
           "' (expected --tokenizer, --out, --val-fraction, --force, --shard-tokens or --threads)");
    if (!inline_value) {
      if (i + 1 >= argc) fail(ErrorKind::Usage, "data prepare: ", flag, " needs a value");
      value = argv[++i];
    }
    if (flag == "--tokenizer") o.tokenizer = value;
    else if (flag == "--out") o.out = value;
    else if (flag == "--val-fraction") o.val_fraction = parse_fraction(flag, value);
    else if (flag == "--threads") o.threads = int(std::min<int64_t>(parse_count(flag, value), 1024));
    else o.shard_tokens = parse_count(flag, value);
  }
  if (o.tokenizer.empty()) fail(ErrorKind::Usage, "data prepare: missing --tokenizer (expected bytes or gpt2)");
  if (o.out.empty()) fail(ErrorKind::Usage, "data prepare: missing --out DIR");
  if (o.inputs.empty()) fail(ErrorKind::Usage, "data prepare: no input files given");
  return o;
}

// Expands directories (their regular files, sorted; fortune index files
// skipped) and checks that every named input exists.
std::vector<std::string> list_inputs(const std::vector<std::string>& inputs) {
  std::vector<std::string> files;
  for (const std::string& in : inputs) {
    std::error_code ec;
    fs::file_status st = fs::status(in, ec);
    if (!fs::exists(st)) fail(ErrorKind::Data, "input file '", in, "' does not exist");
    if (fs::is_directory(st)) {
      std::vector<std::string> found;
      fs::directory_iterator it(in, ec);
      if (ec) fail(ErrorKind::Data, "cannot list input directory '", in, "': ", ec.message());
      for (const auto& e : it) {
        std::string name = e.path().filename().string();
        if (!e.is_regular_file(ec) || name.starts_with(".") || name.ends_with(".dat") || name.ends_with(".u8"))
          continue;
        found.push_back(e.path().string());
      }
      std::sort(found.begin(), found.end());
      if (found.empty()) std::cerr << "warning: input directory '" << in << "' has no text files\n";
      files.insert(files.end(), found.begin(), found.end());
    } else if (fs::is_regular_file(st)) {
      files.push_back(in);
    } else {
      fail(ErrorKind::Data, "input '", in, "' is neither a regular file nor a directory");
    }
  }
  return files;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(ErrorKind::Data, "cannot open input file '", path, "': ", std::strerror(errno));
  std::ostringstream s;
  s << f.rdbuf();
  if (f.bad()) fail(ErrorKind::Data, "cannot read input file '", path, "'");
  return s.str();
}

bool blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; });
}

// A fortune file separates entries with lines holding only "%"; any other
// file is one document. Blank documents are dropped.
std::vector<std::string_view> split_documents(std::string_view text) {
  std::vector<std::string_view> docs;
  size_t doc_begin = 0, pos = 0;
  bool separated = false;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    size_t next = eol == std::string_view::npos ? text.size() : eol + 1;
    std::string_view line = text.substr(pos, (eol == std::string_view::npos ? text.size() : eol) - pos);
    if (line == "%" || line == "%\r") {
      docs.push_back(text.substr(doc_begin, pos - doc_begin));
      doc_begin = next;
      separated = true;
    }
    pos = next;
  }
  if (!separated) docs.assign(1, text);
  else docs.push_back(text.substr(doc_begin));
  std::erase_if(docs, blank);
  return docs;
}

// Held-out choice from the document's text, not its position: adding or
// reordering inputs keeps every other document in its split, and duplicate
// documents land in the same split, so val never contains a copy of train.
double split_draw(std::string_view doc) {
  uint64_t h = fnv1a64(doc.data(), doc.size());
  h ^= h >> 33;  // FNV's high bits mix poorly for short inputs; a murmur finalizer fixes that
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  return double(h >> 11) * 0x1.0p-53;
}

// A progress bar on stderr, redrawn in place; silent when stderr is not a
// terminal, so logs and tests see only the summary on stdout.
class Progress {
 public:
  Progress(const char* what, size_t total_bytes)
      : what_(what), total_(total_bytes), tty_(isatty(STDERR_FILENO) == 1), start_(Clock::now()) {}

  void update(size_t done) {
    if (!tty_) return;
    const double s = seconds(), frac = total_ ? std::min(1.0, double(done) / double(total_)) : 1.0;
    constexpr int kWidth = 30;
    const int filled = int(frac * kWidth);
    std::string bar(size_t(filled), '#');
    bar.resize(kWidth, '.');
    const double rate = s > 0 ? double(done) / s : 0;
    std::fprintf(stderr, "\r%s [%s] %3.0f%%  %.1f/%.1f MB  %.1f MB/s  ETA %.0f s ", what_, bar.c_str(), frac * 100,
                 double(done) / 1e6, double(total_) / 1e6, rate / 1e6,
                 rate > 0 ? double(total_ - std::min(done, total_)) / rate : 0.0);
    drawn_ = true;
  }
  // Ends the line; returns the seconds since construction.
  double finish() {
    if (drawn_) std::fputc('\n', stderr);
    drawn_ = false;
    return seconds();
  }

 private:
  using Clock = std::chrono::steady_clock;
  double seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }
  const char* what_;
  size_t total_;
  bool tty_, drawn_ = false;
  Clock::time_point start_;
};

void print_split(const char* name, const DatasetWriter& w, const DatasetIndex& ix) {
  std::printf("  %-5s %-32s %9lld documents %13lld tokens %5zu shard%s\n", name, w.dir().c_str(),
              (long long)w.documents(), (long long)w.tokens(), ix.shards.size(), ix.shards.size() == 1 ? "" : "s");
}

int prepare(int argc, char** argv) {
  const PrepareOptions o = parse_prepare(argc, argv);
  std::unique_ptr<Tokenizer> tok = make_tokenizer(o.tokenizer);
  const std::vector<std::string> files = list_inputs(o.inputs);

  // Pass 1: read every file and draw each document's split. The whole
  // assignment must be known before writing so a small corpus still gets a
  // non-empty val split; pass 2 reads the files again rather than holding them.
  std::vector<std::vector<bool>> to_val(files.size());
  std::vector<bool> skipped(files.size(), false);
  size_t n_docs = 0, n_val = 0, doc_bytes = 0;
  double lo = 2, hi = -1;
  size_t lo_at[2] = {0, 0}, hi_at[2] = {0, 0};
  for (size_t f = 0; f < files.size(); ++f) {
    std::string text = read_file(files[f]);
    if (text.find('\0') != std::string::npos) {
      std::cerr << "warning: skipping '" << files[f] << "': it contains NUL bytes (a binary file?)\n";
      skipped[f] = true;
      continue;
    }
    std::vector<std::string_view> docs = split_documents(text);
    for (size_t d = 0; d < docs.size(); ++d) {
      double u = split_draw(docs[d]);
      to_val[f].push_back(u < o.val_fraction);
      n_val += u < o.val_fraction;
      if (u < lo) lo = u, lo_at[0] = f, lo_at[1] = d;
      if (u > hi) hi = u, hi_at[0] = f, hi_at[1] = d;
      doc_bytes += docs[d].size();
    }
    n_docs += docs.size();
  }
  if (n_docs == 0) fail(ErrorKind::Data, "data prepare: the inputs hold no documents");
  if (o.val_fraction > 0 && n_val == 0 && n_docs >= 2) to_val[lo_at[0]][lo_at[1]] = true;
  if (n_val == n_docs && n_docs >= 2) to_val[hi_at[0]][hi_at[1]] = false;

  const std::string train_dir = (fs::path(o.out) / "train").string(), val_dir = (fs::path(o.out) / "val").string();
  // Both writers first: a refusal to overwrite happens before anything is written.
  DatasetWriter train(train_dir, tok->name(), tok->vocab_size(), tok->eot_token(), o.shard_tokens, o.force);
  DatasetWriter val(val_dir, tok->name(), tok->vocab_size(), tok->eot_token(), o.shard_tokens, o.force);
  // Pass 2, in batches of whole files (up to kBatchBytes of text, at least
  // one file): read, encode every document of the batch in parallel, write
  // them in input order. Memory stays bounded by the batch, and the output
  // does not depend on the thread count.
  constexpr size_t kBatchBytes = size_t(64) << 20;
  const int threads = o.threads > 0 ? o.threads : default_threads();
  Progress bar("encoding", doc_bytes);
  size_t bytes_before = 0, n_encoded = 0;
  for (size_t f = 0; f < files.size();) {
    std::vector<std::string> texts;
    std::vector<size_t> text_file;
    for (size_t batch = 0; f < files.size() && (texts.empty() || batch < kBatchBytes); ++f) {
      if (skipped[f]) continue;
      texts.push_back(read_file(files[f]));
      text_file.push_back(f);
      batch += texts.back().size();
    }
    std::vector<std::string_view> docs;  // views into texts, which no longer grows
    std::vector<bool> doc_val;
    for (size_t t = 0; t < texts.size(); ++t) {
      std::vector<std::string_view> file_docs = split_documents(texts[t]);
      const std::vector<bool>& split = to_val[text_file[t]];
      if (file_docs.size() != split.size())
        fail(ErrorKind::Data, "input file '", files[text_file[t]], "' changed while it was being prepared");
      docs.insert(docs.end(), file_docs.begin(), file_docs.end());
      doc_val.insert(doc_val.end(), split.begin(), split.end());
    }
    std::vector<std::vector<int32_t>> ids =
        encode_parallel(*tok, docs, threads, [&](size_t done) { bar.update(bytes_before + done); });
    for (size_t d = 0; d < docs.size(); ++d) {
      bytes_before += docs[d].size();
      n_encoded += ids[d].size();
      // GPT-2 convention (llm.c too): the end-of-text token precedes each document.
      if (tok->eot_token() >= 0) ids[d].insert(ids[d].begin(), tok->eot_token());
      (doc_val[d] ? val : train).add_document(ids[d].data(), ids[d].size());
    }
  }
  const double encode_s = bar.finish();
  const DatasetIndex& train_ix = train.finish();
  const DatasetIndex& val_ix = val.finish();

  size_t n_skipped = size_t(std::count(skipped.begin(), skipped.end(), true));
  std::printf("prepared '%s' from %zu files (%zu skipped) with tokenizer %s (vocab %lld)\n", o.out.c_str(),
              files.size() - n_skipped, n_skipped, tok->name().c_str(), (long long)tok->vocab_size());
  print_split("train", train, train_ix);
  print_split("val", val, val_ix);
  std::printf("  encoded %.1f MB into %zu tokens in %.2f s on %d thread%s (%.2fM tokens/s)\n", double(doc_bytes) / 1e6,
              n_encoded, encode_s, threads, threads == 1 ? "" : "s",
              double(n_encoded) / std::max(encode_s, 1e-9) / 1e6);
  if (val.tokens() == 0) {
    std::cerr << "warning: the val split is empty (" << n_docs << " document" << (n_docs == 1 ? "" : "s")
              << " in all)\n";
  } else {
    double ce = unigram_cross_entropy(TokenDataset::open(train_dir), TokenDataset::open(val_dir));
    std::printf("  unigram baseline: val cross-entropy %.4f nats/token under add-one train frequencies\n", ce);
  }
  return 0;
}

void inspect_split(const std::string& dir) {
  TokenDataset ds = TokenDataset::open(dir);
  const DatasetIndex& ix = ds.index();
  std::printf("dataset '%s'\n", dir.c_str());
  std::printf("  format     %s v%d\n", ix.format.c_str(), ix.version);
  std::printf("  tokenizer  %s (vocab %lld, %s tokens, eot %s)\n", ix.tokenizer.c_str(), (long long)ix.vocab_size,
              ix.token_dtype == DType::U32 ? "uint32" : "uint16",
              ix.eot_token < 0 ? "none" : std::to_string(ix.eot_token).c_str());
  std::printf("  contents   %lld tokens, %lld documents, %zu shard%s\n", (long long)ds.num_tokens(),
              (long long)ds.num_documents(), ix.shards.size(), ix.shards.size() == 1 ? "" : "s");
  // Tiny test shards can number thousands; the first few show the pattern.
  constexpr size_t kListed = 8;
  for (size_t i = 0; i < std::min(ix.shards.size(), kListed); ++i) {
    const ShardInfo& s = ix.shards[i];
    std::printf("    %-18s %12lld tokens %9lld documents  checksum %016llx\n", s.file.c_str(), (long long)s.tokens,
                (long long)s.documents, (unsigned long long)s.checksum);
  }
  if (ix.shards.size() > kListed) std::printf("    ... and %zu more shards\n", ix.shards.size() - kListed);
  ds.verify_checksums();
  std::printf("  checksums  ok\n");
  if (ds.num_documents() == 0) return;

  auto [begin, end] = ds.document_span(0);
  const int64_t n = std::min<int64_t>(end - begin, 200);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  ds.read(begin, n, ids.data());
  std::printf("  first document: %lld tokens; the first %lld decoded:\n", (long long)(end - begin), (long long)n);
  std::unique_ptr<Tokenizer> tok;
  try {
    tok = make_tokenizer(ix.tokenizer);
  } catch (const Error& e) {
    // A dataset from a newer build can still be inspected, just not decoded.
    std::printf("  (cannot decode: %s)\n ", e.what());
    for (int32_t id : ids) std::printf(" %d", id);
    std::printf("\n");
    return;
  }
  std::string text = tok->decode(ids.data(), ids.size());
  std::printf("-----\n%s%s-----\n", text.c_str(), text.ends_with('\n') ? "" : "\n");
}

int inspect(int argc, char** argv) {
  if (argc != 3 || std::string_view(argv[2]).starts_with("--"))
    fail(ErrorKind::Usage, "data inspect: expected exactly one dataset directory (xirang data inspect DIR)");
  const std::string dir = argv[2];
  std::error_code ec;
  if (!fs::exists(fs::path(dir) / "index.json", ec)) {
    // The parent that `prepare --out` wrote: inspect both of its splits.
    bool any = false;
    for (const char* split : {"train", "val"}) {
      fs::path sub = fs::path(dir) / split;
      if (!fs::exists(sub / "index.json", ec)) continue;
      if (any) std::printf("\n");
      inspect_split(sub.string());
      any = true;
    }
    if (any) return 0;
  }
  inspect_split(dir);  // throws the "no dataset at" error when there is none
  return 0;
}

struct CodecOptions {
  std::string tokenizer;
  int threads = 0;  // 0: one per core
};

// Flags of `data encode` / `data decode`; both read stdin, so any other
// argument is a mistake worth naming.
CodecOptions parse_codec(int argc, char** argv, const char* verb, bool threads_allowed) {
  CodecOptions o;
  const char* expected = threads_allowed ? "--tokenizer or --threads" : "--tokenizer";
  for (int i = 2; i < argc; ++i) {
    std::string arg = argv[i], flag = arg, value;
    if (!arg.starts_with("--"))
      fail(ErrorKind::Usage, "data ", verb, ": unexpected argument '", arg, "' (it reads stdin: xirang data ", verb,
           " --tokenizer NAME < FILE)");
    bool inline_value = false;
    if (size_t eq = arg.find('='); eq != std::string::npos) {
      flag = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      inline_value = true;
    }
    if (flag != "--tokenizer" && !(threads_allowed && flag == "--threads"))
      fail(ErrorKind::Usage, "data ", verb, ": unknown flag '", flag, "' (expected ", expected, ")");
    if (!inline_value) {
      if (i + 1 >= argc) fail(ErrorKind::Usage, "data ", verb, ": ", flag, " needs a value");
      value = argv[++i];
    }
    if (flag == "--tokenizer") o.tokenizer = value;
    else o.threads = int(std::min<int64_t>(parse_count(flag, value, verb), 1024));
  }
  if (o.tokenizer.empty()) fail(ErrorKind::Usage, "data ", verb, ": missing --tokenizer (expected bytes or gpt2)");
  return o;
}

std::string read_stdin(const char* verb) {
  std::string in;
  char buf[1 << 16];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), stdin)) > 0;) in.append(buf, n);
  if (std::ferror(stdin)) fail(ErrorKind::Data, "data ", verb, ": cannot read stdin: ", std::strerror(errno));
  return in;
}

void write_stdout(std::string_view out) {
  if (std::fwrite(out.data(), 1, out.size(), stdout) != out.size() || std::fflush(stdout) != 0)
    fail(ErrorKind::Data, "cannot write stdout: ", std::strerror(errno));
}

int encode(int argc, char** argv) {
  const CodecOptions o = parse_codec(argc, argv, "encode", true);
  std::unique_ptr<Tokenizer> tok = make_tokenizer(o.tokenizer);
  const std::string text = read_stdin("encode");
  const std::vector<int32_t> ids =
      encode_parallel(*tok, {std::string_view(text)}, o.threads > 0 ? o.threads : default_threads())[0];
  std::string out;
  out.reserve(ids.size() * 6 + 1);
  char num[16];
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out += ' ';
    out.append(num, std::to_chars(num, num + sizeof(num), ids[i]).ptr);
  }
  out += '\n';
  write_stdout(out);
  return 0;
}

int decode(int argc, char** argv) {
  const CodecOptions o = parse_codec(argc, argv, "decode", false);
  std::unique_ptr<Tokenizer> tok = make_tokenizer(o.tokenizer);
  const std::string in = read_stdin("decode");
  std::vector<int32_t> ids;
  const auto space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; };
  for (size_t i = 0; i < in.size();) {
    if (space(in[i])) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < in.size() && !space(in[end])) ++end;
    int32_t id = 0;
    auto [p, ec] = std::from_chars(in.data() + i, in.data() + end, id);
    if (ec != std::errc() || p != in.data() + end)
      fail(ErrorKind::Data, "data decode: '", std::string_view(in).substr(i, std::min<size_t>(end - i, 40)), "' (item ",
           ids.size(), " on stdin) is not a token id");
    ids.push_back(id);
    i = end;
  }
  write_stdout(tok->decode(ids.data(), ids.size()));
  return 0;
}

}  // namespace

int data_command(int argc, char** argv) {
  if (argc < 2)
    fail(ErrorKind::Usage, "data: missing verb (expected prepare, inspect, encode or decode; see xirang data --help)");
  const std::string_view verb = argv[1];
  if (verb == "--help" || verb == "-h" || verb == "help") {
    std::fputs(kUsage, stdout);
    return 0;
  }
  for (int i = 2; i < argc; ++i)
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
  if (verb == "prepare") return prepare(argc, argv);
  if (verb == "inspect") return inspect(argc, argv);
  if (verb == "encode") return encode(argc, argv);
  if (verb == "decode") return decode(argc, argv);
  fail(ErrorKind::Usage, "data: unknown verb '", verb, "' (expected prepare, inspect, encode or decode)");
}

}  // namespace xirang::tools
