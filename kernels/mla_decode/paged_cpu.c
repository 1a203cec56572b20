/* Absorbed MLA decode attention over the paged latent cache, on the CPU, fp32, one thread.
 *
 * Each request reads its blocks in place, twice: once for the scores of every head, once for the
 * weighted sum of their first C columns (the second read finds them in L2: 640 KB per 2,000
 * tokens of tiny). The torch path gathers the blocks into a buffer first and runs two batched
 * products over it, ~2.5x the time at 24 requests of 2,000 tokens.
 *
 * Built with GCC's vector extensions, so the compiler picks the instructions of the machine it
 * runs on (-march=native): 8-lane vectors over the heads for the scores, the widest vectors
 * there are over the columns for the sum. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
#if defined(__AVX512F__)
typedef float fc __attribute__((vector_size(64)));
#else
typedef float fc __attribute__((vector_size(32)));
#endif
#define CL ((int64_t)(sizeof(fc) / sizeof(float)))
#define HG 4 /* heads and column vectors of one pass of the weighted sum: 8 accumulators */
#define CG 2

enum { OK = 0, NO_MEMORY = -1, BAD_TABLE = -2, UNSUPPORTED = -3 };

static inline f8 splat8(float x) { return x - (f8){0}; }
static inline fc splatc(float x) { return x - (fc){0}; } /* x - 0 is x: folds to a broadcast */
static inline fc loadc(const float *p) {
  fc v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline f8 max8(f8 a, f8 b) {
  const i8 gt = a > b;
  return (f8)((gt & (i8)a) | (~gt & (i8)b));
}

/* exp(x) for finite x <= 0: 2^n e^r with |r| <= ln2/2, Cephes' polynomial (about 1 ulp). */
static inline f8 exp8(f8 x) {
  x = max8(x, splat8(-87.0f));
  const f8 t = x * splat8(1.44269504088896341f) + splat8(12582912.0f); /* n in t's low bits */
  const f8 n = t - splat8(12582912.0f);
  f8 r = x - n * splat8(0.693359375f);
  r = r - n * splat8(-2.12194440e-4f);
  f8 p = splat8(1.9875691500e-4f);
  p = p * r + splat8(1.3981999507e-3f);
  p = p * r + splat8(8.3334519073e-3f);
  p = p * r + splat8(4.1665795894e-2f);
  p = p * r + splat8(1.6666665459e-1f);
  p = p * r + splat8(5.0000001201e-1f);
  p = p * r * r + r + splat8(1.0f);
  return (f8)((i8)p + ((i8)t << 23));
}

/* One buffer per thread, grown as needed: [D] query vectors, [len][H/8] scores. */
static __thread float *work;
static __thread int64_t work_floats;

static float *workspace(int64_t n) {
  if (n > work_floats) {
    free(work);
    work = aligned_alloc(64, (size_t)((n * 4 + 63) / 64 * 64));
    work_floats = work ? n : 0;
  }
  return work;
}

/* S[t][hc] = the 8 scores of head chunk hc for token t; returns their running max per head. */
static f8 scores(const f8 *qt, const float *cache, const int64_t *table, int64_t len,
                 int64_t bs, int64_t D, int64_t HC, int64_t hc, f8 *S) {
  f8 m = splat8(-3.0e38f);
  for (int64_t t0 = 0, w = 0; t0 < len; t0 += bs, ++w) {
    const float *rows = cache + table[w] * bs * D;
    const int64_t n = len - t0 < bs ? len - t0 : bs;
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) { /* 8 tokens: 8 independent accumulators hide the FMA latency */
      const float *r = rows + t * D;
      f8 a[8] = {{0}};
      for (int64_t k = 0; k < D; ++k)
        for (int i = 0; i < 8; ++i) a[i] += qt[k] * r[i * D + k];
      for (int i = 0; i < 8; ++i) S[(t0 + t + i) * HC + hc] = a[i], m = max8(m, a[i]);
    }
    for (; t < n; ++t) {
      const float *r = rows + t * D;
      f8 a = {0};
      for (int64_t k = 0; k < D; ++k) a += qt[k] * r[k];
      S[(t0 + t) * HC + hc] = a;
      m = max8(m, a);
    }
  }
  return m;
}

/* out[h0 + i][c0 ...] = inv[h0 + i] * sum_t P[t][h0 + i] * row_t[c0 ...], HG heads x CG vectors. */
static void weighted_sum(const float *P, const float *cache, const int64_t *table, int64_t len,
                         int64_t bs, int64_t D, int64_t H, int64_t C, int64_t h0, int64_t c0,
                         const float *inv, float *out) {
  fc acc[HG][CG];
  for (int i = 0; i < HG; ++i)
    for (int j = 0; j < CG; ++j) acc[i][j] = (fc){0};
  for (int64_t t0 = 0, w = 0; t0 < len; t0 += bs, ++w) {
    const float *row = cache + table[w] * bs * D + c0;
    const float *p = P + t0 * H + h0;
    const int64_t n = len - t0 < bs ? len - t0 : bs;
    for (int64_t t = 0; t < n; ++t, row += D, p += H) {
      fc r[CG];
      for (int j = 0; j < CG; ++j) r[j] = loadc(row + j * CL);
      for (int i = 0; i < HG; ++i)
        for (int j = 0; j < CG; ++j) acc[i][j] += splatc(p[i]) * r[j];
    }
  }
  for (int i = 0; i < HG; ++i)
    for (int j = 0; j < CG; ++j) {
      const fc v = acc[i][j] * inv[h0 + i];
      memcpy(out + (h0 + i) * C + c0 + j * CL, &v, sizeof v);
    }
}

static int check(const int64_t *tables, const int64_t *lens, int64_t B, int64_t bs, int64_t W,
                 int64_t num_blocks) {
  for (int64_t b = 0; b < B; ++b) {
    if (lens[b] < 1 || lens[b] > W * bs) return BAD_TABLE;
    for (int64_t w = 0; w < (lens[b] + bs - 1) / bs; ++w)
      if (tables[b * W + w] < 0 || tables[b * W + w] >= num_blocks) return BAD_TABLE;
  }
  return OK;
}

/* q [B, H, D] (q_nope times W_UK, then q_rope), cache [num_blocks, bs, D], tables [B, W],
 * lens [B] -> out [B, H, C]: softmax(q k^T scale) times the first C columns of k, over the
 * first lens[b] tokens of request b. All contiguous. Returns OK, or why not: UNSUPPORTED
 * (H % 8 or C % (CG * vector width) not 0), BAD_TABLE (a length or block out of range),
 * NO_MEMORY. */
int ferry_mla_decode_f32(const float *q, const float *cache, const int64_t *tables,
                         const int64_t *lens, float *out, int64_t B, int64_t H, int64_t D,
                         int64_t C, int64_t bs, int64_t W, int64_t num_blocks, float scale) {
  if (H % 8 || C % (CG * CL) || C > D) return UNSUPPORTED;
  const int rc = check(tables, lens, B, bs, W, num_blocks);
  if (rc != OK) return rc;
  const int64_t HC = H / 8;
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) max_len = lens[b] > max_len ? lens[b] : max_len;
  float *buf = workspace(HC * D * 8 + max_len * H + H);
  if (!buf) return NO_MEMORY;
  f8 *qt = (f8 *)buf;                  /* [HC][D]: 8 heads' scaled queries per k */
  f8 *S = qt + HC * D;                 /* [len][HC] */
  float *inv = (float *)(S + max_len * HC); /* [H] 1 / each head's softmax denominator */
  for (int64_t b = 0; b < B; ++b) {
    const float *qb = q + b * H * D;
    const int64_t *table = tables + b * W;
    const int64_t len = lens[b];
    for (int64_t hc = 0; hc < HC; ++hc) {
      for (int64_t k = 0; k < D; ++k)
        for (int l = 0; l < 8; ++l) qt[hc * D + k][l] = qb[(hc * 8 + l) * D + k] * scale;
      const f8 m = scores(qt + hc * D, cache, table, len, bs, D, HC, hc, S);
      f8 sum = {0};
      for (int64_t t = 0; t < len; ++t) {
        const f8 p = exp8(S[t * HC + hc] - m);
        S[t * HC + hc] = p;
        sum += p;
      }
      for (int l = 0; l < 8; ++l) inv[hc * 8 + l] = 1.0f / sum[l];
    }
    for (int64_t h0 = 0; h0 < H; h0 += HG)
      for (int64_t c0 = 0; c0 < C; c0 += CG * CL)
        weighted_sum((const float *)S, cache, table, len, bs, D, H, C, h0, c0, inv,
                     out + b * H * C);
  }
  return OK;
}
