/* One-pass threshold selection on the CPU (commlab.compress.native; docs/performance.md,
 * "Selection passes").
 *
 * select_f32 finds the positions i of a float32 array with !(|x[i]| < t), that is |x| >= t or
 * x NaN (the caller keeps t >= the smallest positive float, so zeros never pass), in ascending
 * order, and (when asked) their values. Each thread reads its chunk once: it compares a vector of
 * x against t and left-packs the positions that pass, and their values, into its own part of an
 * int32 (and a float32) buffer (AVX-512: a compress; AVX2: a permutation looked up from the
 * comparison's bit mask; else a scalar loop). The chunks run in an OpenMP parallel loop. The
 * values come from the vector already loaded: gathering them afterwards would miss the cache once
 * per selected entry. Stores are
 * unconditional and the count advances by the mask's popcount, so there is no branch on the data
 * to mispredict. A thread only ever writes at or before the position it is reading, so chunk j's
 * output stays within chunk j's part of the buffer (chunks start at multiples of 16).
 * gather_chunks then widens the chunks' positions, in order, into the int64 result (and copies
 * the values).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define MAX_THREADS 64  /* the Python side passes at most this many */
#define ALIGN 16
#define MAX_THRESHOLDS 64  /* count_f32 counts at most this many thresholds per call */

const char* variant(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "scalar";
#endif
}

#if defined(__AVX2__) && !defined(__AVX512F__)
/* For each 8-bit mask, the lanes whose bit is set, first (the left-pack permutation). */
static int32_t pack_table[256][8];
static pthread_once_t pack_once = PTHREAD_ONCE_INIT;
static void fill_pack_table(void) {
    for (int m = 0; m < 256; m++) {
        int c = 0;
        for (int lane = 0; lane < 8; lane++)
            if (m & (1 << lane)) pack_table[m][c++] = lane;
        while (c < 8) pack_table[m][c++] = 0;
    }
}
#endif

/* Positions in [lo, hi) passing t, written from out[0] (values from vals[0] when vals is not
 * NULL); returns how many. */
static int64_t pass_chunk(const float* x, int64_t lo, int64_t hi, float t, int32_t* out, float* vals) {
    int64_t c = 0, i = lo;
#if defined(__AVX512F__)
    const __m512 vt = _mm512_set1_ps(t);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int32_t)lo),
                                   _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    for (; i + 16 <= hi; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        __mmask16 m = _mm512_cmp_ps_mask(_mm512_abs_ps(v), vt, _CMP_NLT_UQ);
        _mm512_storeu_si512((void*)(out + c), _mm512_maskz_compress_epi32(m, idx));
        if (vals) _mm512_storeu_ps(vals + c, _mm512_maskz_compress_ps(m, v));
        c += __builtin_popcount((unsigned)m);
        idx = _mm512_add_epi32(idx, step);
    }
#elif defined(__AVX2__)
    const __m256 vt = _mm256_set1_ps(t);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i step = _mm256_set1_epi32(8);
    __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int32_t)lo), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (; i + 8 <= hi; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        unsigned m = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, v), vt, _CMP_NLT_UQ));
        __m256i perm = _mm256_loadu_si256((const __m256i*)pack_table[m]);
        _mm256_storeu_si256((__m256i*)(out + c), _mm256_permutevar8x32_epi32(idx, perm));
        if (vals) _mm256_storeu_ps(vals + c, _mm256_permutevar8x32_ps(v, perm));
        c += __builtin_popcount(m);
        idx = _mm256_add_epi32(idx, step);
    }
#endif
    for (; i < hi; i++) {  /* the tail (and the whole chunk without SIMD) */
        out[c] = (int32_t)i;
        if (vals) vals[c] = x[i];
        c += !(fabsf(x[i]) < t);
    }
    return c;
}

struct chunk {
    const float* x;
    int64_t lo, hi;
    float t;
    int32_t* buf;
    float* vals;
    int64_t count;
};

static void run_chunk(struct chunk* ch) {
    ch->count = pass_chunk(ch->x, ch->lo, ch->hi, ch->t, ch->buf + ch->lo, ch->vals ? ch->vals + ch->lo : 0);
}

static int64_t chunk_length(int64_t n, int threads) {
    return ((n + threads - 1) / threads + ALIGN - 1) / ALIGN * ALIGN;  /* ceil(n / threads), rounded up */
}

/* Chunk j of n elements cut in chunks of len: [*lo, *hi), empty past the end. */
static void chunk_range(int64_t n, int64_t len, int j, int64_t* lo, int64_t* hi) {
    *lo = j * len < n ? j * len : n;
    *hi = (j + 1) * len < n ? (j + 1) * len : n;
}

/* Positions of x[0..n) passing t, per chunk: counts[j] of them from buf[j * chunk_length] (and
 * their values from vals[j * chunk_length] unless vals is NULL); returns the total. buf holds n
 * int32, vals n float32. With OpenMP the chunks run on the process's OpenMP workers: torch's
 * own, already started (and often still spinning from torch's last parallel region), since the
 * process has loaded torch's libgomp before this library. */
int64_t select_f32(const float* x, int64_t n, float t, int32_t* buf, float* vals, int threads, int64_t* counts) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    pthread_once(&pack_once, fill_pack_table);
#endif
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    struct chunk chunks[MAX_THREADS];
    int64_t len = chunk_length(n, threads);
    for (int j = 0; j < threads; j++) {
        int64_t lo, hi;
        chunk_range(n, len, j, &lo, &hi);
        chunks[j] = (struct chunk){x, lo, hi, t, buf, vals, 0};
    }
#if defined(_OPENMP)
#pragma omp parallel for schedule(static, 1) num_threads(threads) if (threads > 1)
#endif
    for (int j = 0; j < threads; j++) run_chunk(&chunks[j]);
    int64_t total = 0;
    for (int j = 0; j < threads; j++) {
        counts[j] = chunks[j].count;
        total += chunks[j].count;
    }
    return total;
}

/* out[0..total) <- the positions select_f32 left in buf, chunk after chunk (ascending), and
 * out_vals <- their values when neither vals nor out_vals is NULL. */
void gather_chunks(const int32_t* buf, const float* vals, int64_t n, int threads, const int64_t* counts,
                   int64_t* out, float* out_vals) {
    int64_t len = chunk_length(n, threads < 1 ? 1 : threads), c = 0;
    for (int j = 0; j < threads; j++) {
        const int32_t* part = buf + j * len;
        if (vals && out_vals) memcpy(out_vals + c, vals + j * len, (size_t)counts[j] * sizeof(float));
        for (int64_t i = 0; i < counts[j]; i++) out[c++] = part[i];
    }
}

/* counts[j] <- how many of x[0..n) have !(|x| < ts[j]), for m thresholds, in one read of x (each
 * vector of x compared against every threshold while it is in a register). */
void count_f32(const float* x, int64_t n, const float* ts, int m, int threads, int64_t* counts) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (m > MAX_THRESHOLDS) m = MAX_THRESHOLDS;
    int64_t len = chunk_length(n, threads);
    int64_t part[MAX_THREADS][MAX_THRESHOLDS];
#if defined(_OPENMP)
#pragma omp parallel for schedule(static, 1) num_threads(threads) if (threads > 1)
#endif
    for (int c = 0; c < threads; c++) {
        int64_t lo, hi;
        chunk_range(n, len, c, &lo, &hi);
        int64_t i = lo;
        int64_t* mine = part[c];
        for (int j = 0; j < m; j++) mine[j] = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= hi; i += 16) {
            __m512 v = _mm512_abs_ps(_mm512_loadu_ps(x + i));
            for (int j = 0; j < m; j++)
                mine[j] += __builtin_popcount((unsigned)_mm512_cmp_ps_mask(v, _mm512_set1_ps(ts[j]), _CMP_NLT_UQ));
        }
#elif defined(__AVX2__)
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= hi; i += 8) {
            __m256 v = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
            for (int j = 0; j < m; j++)
                mine[j] += __builtin_popcount(
                    (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(ts[j]), _CMP_NLT_UQ)));
        }
#endif
        for (; i < hi; i++) {
            float a = fabsf(x[i]);
            for (int j = 0; j < m; j++) mine[j] += !(a < ts[j]);
        }
    }
    for (int j = 0; j < m; j++) {
        counts[j] = 0;
        for (int c = 0; c < threads; c++) counts[j] += part[c][j];
    }
}
