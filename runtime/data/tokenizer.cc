#include "runtime/data/tokenizer.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "runtime/data/bpe.h"

namespace xirang {

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(const int32_t* ids, size_t n) const {
  std::string text(n, '\0');
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] > 255)
      fail(ErrorKind::Data, "bytes tokenizer: cannot decode token id ", ids[i], " at position ", i,
           " (expected 0..255)");
    text[i] = static_cast<char>(static_cast<unsigned char>(ids[i]));
  }
  return text;
}

std::unique_ptr<Tokenizer> make_tokenizer(std::string_view name) {
  if (name == "bytes") return std::make_unique<ByteTokenizer>();
  if (name == "gpt2") return Gpt2Tokenizer::load(Gpt2Tokenizer::default_vocab_dir());
  fail(ErrorKind::Config, "unknown tokenizer '", name, "' (expected bytes or gpt2)");
}

size_t next_safe_cut(std::string_view text, size_t target) {
  for (size_t p = std::max<size_t>(target, 1); p < text.size(); ++p) {
    const auto before = static_cast<unsigned char>(text[p - 1]);
    if ((text[p] == ' ' || text[p] == '\n') && before > ' ' && before < 0x7F) return p;
  }
  return text.size();
}

namespace {

struct Piece {
  size_t text;           // index into texts
  std::string_view str;  // a safe-cut slice of it
};

// Every text in pieces of about piece_bytes, cut where encoding the pieces
// gives the ids of the whole (next_safe_cut); an empty text is one empty piece.
std::vector<Piece> cut_pieces(const std::vector<std::string_view>& texts, size_t piece_bytes) {
  std::vector<Piece> pieces;
  for (size_t t = 0; t < texts.size(); ++t) {
    std::string_view s = texts[t];
    do {
      const size_t cut = s.size() > piece_bytes ? next_safe_cut(s, piece_bytes) : s.size();
      pieces.push_back(Piece{t, s.substr(0, cut)});
      s.remove_prefix(cut);
    } while (!s.empty());
  }
  return pieces;
}

// Encodes every piece on up to `threads` threads, reporting progress from
// the calling thread; rethrows the first worker's error.
std::vector<std::vector<int32_t>> encode_pieces(const Tokenizer& tok, const std::vector<Piece>& pieces, int threads,
                                                const std::function<void(size_t)>& progress) {
  std::vector<std::vector<int32_t>> piece_ids(pieces.size());
  std::atomic<size_t> next{0}, bytes_done{0};
  std::exception_ptr error;
  std::mutex mu;
  std::condition_variable finished;
  int running = std::max(1, std::min<int>(threads, int(pieces.size())));
  // Workers take pieces in order from a shared counter; each piece's ids land
  // in its own slot, so the output order never depends on the scheduling.
  const auto work = [&] {
    try {
      for (size_t k; (k = next.fetch_add(1)) < pieces.size();) {
        piece_ids[k] = tok.encode(pieces[k].str);
        bytes_done += pieces[k].str.size();
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!error) error = std::current_exception();
      next = pieces.size();  // the others stop after their current piece
    }
    std::lock_guard<std::mutex> lock(mu);
    if (--running == 0) finished.notify_all();
  };
  std::vector<std::thread> pool;
  for (int i = 0, n = running; i < n; ++i) pool.emplace_back(work);
  {
    std::unique_lock<std::mutex> lock(mu);
    while (!finished.wait_for(lock, std::chrono::milliseconds(100), [&] { return running == 0; }))
      if (progress) {
        lock.unlock();
        progress(bytes_done.load());
        lock.lock();
      }
  }
  for (std::thread& t : pool) t.join();
  if (error) std::rethrow_exception(error);
  if (progress) progress(bytes_done.load());
  return piece_ids;
}

}  // namespace

std::vector<std::vector<int32_t>> encode_parallel(const Tokenizer& tok, const std::vector<std::string_view>& texts,
                                                  int threads, const std::function<void(size_t)>& progress,
                                                  size_t piece_bytes) {
  const std::vector<Piece> pieces = cut_pieces(texts, piece_bytes);
  std::vector<std::vector<int32_t>> piece_ids = encode_pieces(tok, pieces, threads, progress);
  // Each text's ids are its pieces' ids, concatenated in order.
  std::vector<std::vector<int32_t>> ids(texts.size());
  for (size_t k = 0; k < pieces.size(); ++k) {
    std::vector<int32_t>& out = ids[pieces[k].text];
    if (out.empty()) out = std::move(piece_ids[k]);
    else out.insert(out.end(), piece_ids[k].begin(), piece_ids[k].end());
  }
  return ids;
}

}  // namespace xirang
