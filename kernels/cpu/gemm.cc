// The CPU's single-precision matrix product on OpenBLAS or oneDNN (see gemm.h).
#include "kernels/cpu/gemm.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#ifdef XIRANG_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.h>
#endif

#include "core/error.h"

extern "C" char* openblas_get_corename(void);

namespace xirang::cpu {

namespace {

bool cpu_has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

std::string isa_words() {
  std::string s = cpu_has_avx512() ? "AVX-512" : __builtin_cpu_supports("avx2") ? "AVX2" : "no AVX2";
  if (__builtin_cpu_supports("avx512bf16")) s += " with BF16";
  return s;
}

}  // namespace

GemmPath choose_gemm_path(const std::string& setting) {
  const std::string want = setting.empty() ? "auto" : setting;
  const std::string core = std::string("OpenBLAS core ") + openblas_get_corename();
  const std::string cpu = "CPU: " + isa_words();
  if (want == "openblas") return {GemmPath::OpenBlas, "openblas", "XIRANG_CPU_GEMM=openblas; " + cpu + "; " + core};
  if (want == "onednn") {
    if (!have_onednn())
      fail(ErrorKind::Usage, "XIRANG_CPU_GEMM=onednn, but this build has no oneDNN (install libdnnl-dev and rebuild)");
    return {GemmPath::OneDnn, "onednn", "XIRANG_CPU_GEMM=onednn; " + cpu};
  }
  if (want != "auto")
    fail(ErrorKind::Usage, "XIRANG_CPU_GEMM='", want, "' is not a GEMM path (expected auto, openblas or onednn)");
  if (have_onednn() && cpu_has_avx512())
    return {GemmPath::OneDnn, "onednn", "auto: " + cpu + ", kernels generated for it by oneDNN"};
  return {GemmPath::OpenBlas, "openblas", "auto: " + cpu + (have_onednn() ? "" : ", no oneDNN in this build") +
                                              "; " + core};
}

namespace {

void openblas_sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                    const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B,
              ldb, beta, C, ldc);
}

// The number of blocks is the largest of kBlockCounts that leaves each block
// at least kMinBlockWidth rows or columns (so that the operand every block
// shares is packed again seldom) and kFlopsPerBlock of work (about 0.3 ms of
// one core). The counts divide evenly among 1, 2, 3, 4 or 6 threads.
constexpr double kFlopsPerBlock = 32e6;
constexpr int64_t kMinBlockWidth = 128;
constexpr int64_t kBlockCounts[] = {48, 24, 16, 12, 8, 6, 4, 2, 1};

// Rows (M >= N) or columns of C cut into blocks by shape alone; run(s, w)
// computes the block of `w` rows or columns from `s` on the calling thread.
struct Blocking {
  int64_t extent, width, blocks;  // rows or columns cut, each block's, how many
  int64_t last() const { return extent - (blocks - 1) * width; }
};

Blocking blocking_of(int64_t M, int64_t N, int64_t K) {
  const double flops = 2.0 * double(M) * double(N) * double(K);
  const int64_t D = M >= N ? M : N;
  int64_t count = 1;
  for (int64_t c : kBlockCounts)
    if (D / c >= kMinBlockWidth && flops / double(c) >= kFlopsPerBlock) {
      count = c;
      break;
    }
  const int64_t width = (D + count - 1) / count;
  return {D, width, (D + width - 1) / width};
}

template <class Run>
void run_blocks(int64_t M, int64_t N, int64_t K, Run&& run) {
  const Blocking bl = blocking_of(M, N, K);
  const int64_t D = bl.extent, width = bl.width, blocks = bl.blocks;
  auto block = [&](int64_t b) { run(b * width, std::min(D, b * width + width) - b * width); };
  if (omp_in_parallel()) {  // the library runs on this thread alone
    for (int64_t b = 0; b < blocks; ++b) block(b);
    return;
  }
  if (blocks == 1) {  // one block: one thread, so that the library cannot split it
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    block(0);
    omp_set_num_threads(threads);
    return;
  }
  // Each block runs inside the region, where the library plans for one thread.
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) block(b);
}

// C's row (M >= N) or column blocks, each one single-threaded call of
// `call`, on either path: oneDNN's threading may split K, and OpenBLAS's
// threaded driver partitions by the thread count with results that change
// with that partition (its OpenMP build runs on the calling thread inside a
// parallel region, and on one thread when omp_set_num_threads(1) says so).
template <class Call>
void blocked_sgemm(Call&& call, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                   int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const bool by_rows = M >= N;
  run_blocks(M, N, K, [&](int64_t s, int64_t w) {
    if (by_rows)
      call(ta, tb, w, N, K, alpha, ta ? A + s : A + s * lda, lda, B, ldb, beta, C + s * ldc, ldc);
    else
      call(ta, tb, M, w, K, alpha, A, lda, tb ? B + s * ldb : B + s, ldb, beta, C + s, ldc);
  });
}

#ifdef XIRANG_HAVE_ONEDNN
void onednn_call(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                 const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  dnnl_status_t st = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  if (st != dnnl_success)
    fail(ErrorKind::Library, "sgemm: oneDNN refused a (", M, ", ", N, ", ", K, ") product with status ", int(st));
}

// ---------------------------------------------------------------- bf16 matmul

// oneDNN's matmul primitive with bf16 operands: the CPU's BF16 dot products
// where it has them. A primitive is made per block shape (with strides,
// output type, alpha, beta, bias), planned for one thread, and kept by the
// thread that made it, so that no two threads run the same primitive object
// at once (sharing one gave wrong results; a thread's OpenMP number does not
// tell threads apart: it repeats across teams and outside them).
struct MatmulKey {
  bool ta, tb, c_bf16, bias;
  int64_t M, N, K, lda, ldb, ldc;
  float alpha, beta;
  auto tie() const { return std::tie(ta, tb, c_bf16, bias, M, N, K, lda, ldb, ldc, alpha, beta); }
  bool operator<(const MatmulKey& o) const { return tie() < o.tie(); }
};

dnnl_engine_t cpu_engine() {
  static dnnl_engine_t engine = [] {
    dnnl_engine_t e = nullptr;
    if (dnnl_engine_create(&e, dnnl_cpu, 0) != dnnl_success) e = nullptr;
    return e;
  }();
  return engine;
}

// One thread's primitive for a block shape, with its memory objects made
// once (each call only points them at its operands). `prim` is null where
// oneDNN has no bf16 matmul with the CPU's own bf16 instructions (a
// reference or emulated kernel would be slower than widening to fp32).
struct Matmul {
  dnnl_primitive_t prim = nullptr;
  dnnl_memory_t mem[4] = {};  // A, B, C, bias
  explicit Matmul(const MatmulKey& k);
  ~Matmul() {
    for (dnnl_memory_t m : mem)
      if (m) dnnl_memory_destroy(m);
    if (prim) dnnl_primitive_destroy(prim);
  }
  Matmul(const Matmul&) = delete;
  Matmul& operator=(const Matmul&) = delete;
};

Matmul::Matmul(const MatmulKey& k) {
  dnnl_engine_t engine = cpu_engine();
  if (!engine) return;
  dnnl_memory_desc_t a, b, c, bias;
  dnnl_dims_t ad = {k.M, k.K}, as = {k.ta ? 1 : k.lda, k.ta ? k.lda : 1};
  dnnl_dims_t bd = {k.K, k.N}, bs = {k.tb ? 1 : k.ldb, k.tb ? k.ldb : 1};
  dnnl_dims_t cd = {k.M, k.N}, cs = {k.ldc, 1};
  dnnl_dims_t biasd = {1, k.N}, biass = {k.N, 1};
  bool ok = dnnl_memory_desc_init_by_strides(&a, 2, ad, dnnl_bf16, as) == dnnl_success &&
            dnnl_memory_desc_init_by_strides(&b, 2, bd, dnnl_bf16, bs) == dnnl_success &&
            dnnl_memory_desc_init_by_strides(&c, 2, cd, k.c_bf16 ? dnnl_bf16 : dnnl_f32, cs) == dnnl_success &&
            dnnl_memory_desc_init_by_strides(&bias, 2, biasd, dnnl_bf16, biass) == dnnl_success;
  dnnl_matmul_desc_t op;
  dnnl_primitive_attr_t attr = nullptr;
  dnnl_post_ops_t post = nullptr;
  dnnl_primitive_desc_t pd = nullptr;
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);  // planned for the one thread that runs each block
  ok = ok && dnnl_matmul_desc_init(&op, &a, &b, k.bias ? &bias : nullptr, &c) == dnnl_success &&
       dnnl_primitive_attr_create(&attr) == dnnl_success;
  if (ok && k.alpha != 1.0f) ok = dnnl_primitive_attr_set_output_scales(attr, 1, 0, &k.alpha) == dnnl_success;
  if (ok && k.beta != 0.0f)
    ok = dnnl_post_ops_create(&post) == dnnl_success && dnnl_post_ops_append_sum(post, k.beta) == dnnl_success &&
         dnnl_primitive_attr_set_post_ops(attr, post) == dnnl_success;
  if (ok) ok = dnnl_primitive_desc_create(&pd, &op, attr, engine, nullptr) == dnnl_success;
  if (ok) {
    const char* impl = nullptr;
    dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl);
    ok = impl && std::strstr(impl, "avx512_core_bf16") != nullptr;
  }
  // Memory objects with no data yet (DNNL_MEMORY_NONE): run() sets the handles.
  ok = ok && dnnl_memory_create(&mem[0], &a, engine, DNNL_MEMORY_NONE) == dnnl_success &&
       dnnl_memory_create(&mem[1], &b, engine, DNNL_MEMORY_NONE) == dnnl_success &&
       dnnl_memory_create(&mem[2], &c, engine, DNNL_MEMORY_NONE) == dnnl_success &&
       (!k.bias || dnnl_memory_create(&mem[3], &bias, engine, DNNL_MEMORY_NONE) == dnnl_success);
  if (ok && dnnl_primitive_create(&prim, pd) != dnnl_success) prim = nullptr;
  omp_set_num_threads(threads);
  if (pd) dnnl_primitive_desc_destroy(pd);
  if (post) dnnl_post_ops_destroy(post);
  if (attr) dnnl_primitive_attr_destroy(attr);
}

// This thread's Matmul for `k`, made on first use.
Matmul& matmul_for(const MatmulKey& k) {
  thread_local std::map<MatmulKey, std::unique_ptr<Matmul>> made;
  std::unique_ptr<Matmul>& m = made[k];
  if (!m) m = std::make_unique<Matmul>(k);
  return *m;
}

bool have_matmul(const MatmulKey& k) { return matmul_for(k).prim != nullptr; }

void run_matmul(const MatmulKey& k, const void* A, const void* B, void* C, const void* bias) {
  Matmul& m = matmul_for(k);
  if (!m.prim)  // bf16_gemm checked the block shapes on its own thread; another thread making none is not expected
    fail(ErrorKind::Library, "bf16 matmul: oneDNN made no primitive for a (", k.M, ", ", k.N, ", ", k.K,
         ") block on this thread");
  thread_local dnnl_stream_t stream = nullptr;
  if (!stream && dnnl_stream_create(&stream, cpu_engine(), dnnl_stream_default_flags) != dnnl_success)
    fail(ErrorKind::Library, "bf16 matmul: oneDNN cannot create a CPU stream");
  bool ok = dnnl_memory_set_data_handle(m.mem[0], const_cast<void*>(A)) == dnnl_success &&
            dnnl_memory_set_data_handle(m.mem[1], const_cast<void*>(B)) == dnnl_success &&
            dnnl_memory_set_data_handle(m.mem[2], C) == dnnl_success &&
            (!k.bias || dnnl_memory_set_data_handle(m.mem[3], const_cast<void*>(bias)) == dnnl_success);
  dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, m.mem[0]}, {DNNL_ARG_WEIGHTS, m.mem[1]}, {DNNL_ARG_DST, m.mem[2]},
                             {DNNL_ARG_BIAS, m.mem[3]}};
  dnnl_status_t st = dnnl_runtime_error;
  if (ok) {
    st = dnnl_primitive_execute(m.prim, stream, k.bias ? 4 : 3, args);
    dnnl_stream_wait(stream);
  }
  if (st != dnnl_success)
    fail(ErrorKind::Library, "bf16 matmul: oneDNN refused a (", k.M, ", ", k.N, ", ", k.K, ") product with status ",
         int(st));
}
#endif

}  // namespace

bool bf16_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda,
               const void* B, int64_t ldb, float beta, void* C, bool c_bf16, int64_t ldc, const void* bias) {
#ifdef XIRANG_HAVE_ONEDNN
  if (gemm_path().kind != GemmPath::OneDnn || M <= 0 || N <= 0 || K <= 0 || (bias && beta != 0.0f)) return false;
  const bool by_rows = M >= N;
  const size_t csize = c_bf16 ? 2 : 4;
  // oneDNN's BF16 kernel (brgemm) wants C dense: a block of columns is
  // computed into scratch of its own width and copied into place.
  auto key = [&](int64_t w) {
    return MatmulKey{ta, tb, c_bf16, bias != nullptr, by_rows ? w : M, by_rows ? N : w, K, lda, ldb,
                     by_rows ? ldc : w, alpha, beta};
  };
  // Every block shape (at most two: the full width and the last block's)
  // must have a primitive; otherwise the caller converts.
  const Blocking bl = blocking_of(M, N, K);
  if (!have_matmul(key(bl.width)) || !have_matmul(key(bl.last()))) return false;
  const auto* a = static_cast<const uint16_t*>(A);
  const auto* b = static_cast<const uint16_t*>(B);
  const auto* bi = static_cast<const uint16_t*>(bias);
  auto* c = static_cast<char*>(C);
  run_blocks(M, N, K, [&](int64_t s, int64_t w) {
    const MatmulKey k = key(w);
    if (by_rows) {
      run_matmul(k, ta ? a + s : a + s * lda, b, c + size_t(s * ldc) * csize, bi);
      return;
    }
    thread_local std::vector<char> scratch;
    scratch.resize(size_t(M * w) * csize);
    const size_t row = size_t(w) * csize;
    if (beta != 0.0f)
      for (int64_t i = 0; i < M; ++i) std::memcpy(scratch.data() + i * row, c + size_t(i * ldc + s) * csize, row);
    run_matmul(k, a, tb ? b + s * ldb : b + s, scratch.data(), bi ? bi + s : nullptr);
    for (int64_t i = 0; i < M; ++i) std::memcpy(c + size_t(i * ldc + s) * csize, scratch.data() + i * row, row);
  });
  return true;
#else
  return false;
#endif
}

bool have_onednn() {
#ifdef XIRANG_HAVE_ONEDNN
  return true;
#else
  return false;
#endif
}

namespace {
GemmPath& current_path() {
  static GemmPath path = [] {
    const char* env = std::getenv("XIRANG_CPU_GEMM");
    return choose_gemm_path(env ? env : "");
  }();
  return path;
}
}  // namespace

const GemmPath& gemm_path() { return current_path(); }

void set_gemm_path(const std::string& setting) { current_path() = choose_gemm_path(setting); }

void sgemm_on(GemmPath::Kind path, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
              int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // an empty sum: C = beta C as BLAS defines it (OpenBLAS returns early instead)
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
    return;
  }
#ifdef XIRANG_HAVE_ONEDNN
  if (path == GemmPath::OneDnn) return blocked_sgemm(onednn_call, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#else
  if (path == GemmPath::OneDnn) fail(ErrorKind::Usage, "sgemm: this build has no oneDNN");
#endif
  blocked_sgemm(openblas_sgemm, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  sgemm_on(gemm_path().kind, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void dgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A, int64_t lda,
           const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B,
              ldb, beta, C, ldc);
}

}  // namespace xirang::cpu
