/* One-pass threshold selection on the CPU (commlab.compress.native; docs/performance.md,
 * "Selection passes").
 *
 * select_f32 finds the positions i of a float32 array with !(|x[i]| < t), that is |x| >= t or
 * x NaN (the caller keeps t >= the smallest positive float, so zeros never pass), in ascending
 * order, and (when asked) their values. Each thread reads its chunk once: it compares a vector of
 * x against t and left-packs the positions that pass, and their values, into its own part of an
 * int32 (and a float32) buffer (AVX-512: a compress; AVX2: a permutation looked up from the
 * comparison's bit mask; else a scalar loop). The chunks run in an OpenMP parallel loop. The
 * values come from the vector already loaded, or, where few pass, from the block of 1024 entries
 * just read (still in L1): gathering them after the pass would miss the cache once per selected
 * entry. Stores are unconditional and the count advances by the mask's popcount, so
 * there is no branch on the data to mispredict (peeling the set bits of 64-entry words instead,
 * with a branch per word, is faster only on a tensor the branch predictor has seen before, and
 * slower on the fresh tensors a training run selects from). A thread only ever
 * writes at or before the position it is reading, so chunk j's output stays within chunk j's part
 * of the buffer (chunks start at multiples of 16). With values, each thread then counts its selected
 * values passing a few higher thresholds (a guard's raises: Ok-Topk's guard, counted among the
 * selected entries while they are in cache, with no second pass over x), and the call keeps
 * the pairs passing the raise the guard picks. A second parallel loop of the same call then
 * widens each chunk's positions into the int64 result at the chunk's offset (and copies the
 * values), when the caller's room holds them; else gather_chunks does it into larger room. One
 * call, so that the host runs no Python between the pass and the result: right after a pass that
 * has evicted the caches, each Python step there costs several times its usual time.
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

/* With AVX-512, a block of BLOCK entries whose block before kept at most 1 in SPARSE compresses
 * only the positions, then loads the few values from the block it has just read (in L1): where
 * few pass, a second compress per vector costs more than those loads; where many pass, the loads
 * cost more. The output is the same either way. */
#define BLOCK 1024
#define SPARSE 16

/* Positions in [lo, hi) passing t, written from out[0] (values from vals[0] when vals is not
 * NULL); returns how many. */
static int64_t pass_chunk(const float* x, int64_t lo, int64_t hi, float t, int32_t* out, float* vals) {
    int64_t c = 0, i = lo;
#if defined(__AVX512F__)
    const __m512 vt = _mm512_set1_ps(t);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int32_t)lo),
                                   _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    int sparse = 1;
    while (i + 16 <= hi) {
        int64_t end = i + BLOCK < hi ? i + BLOCK : hi, before = c;
        if (sparse || !vals) {  /* the positions only; then the few values, from the block in L1 */
            for (; i + 16 <= end; i += 16) {
                __mmask16 m = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + i)), vt, _CMP_NLT_UQ);
                _mm512_storeu_si512((void*)(out + c), _mm512_maskz_compress_epi32(m, idx));
                c += __builtin_popcount((unsigned)m);
                idx = _mm512_add_epi32(idx, step);
            }
            if (vals)
                for (int64_t j = before; j < c; j++) vals[j] = x[out[j]];
        } else {
            for (; i + 16 <= end; i += 16) {
                __m512 v = _mm512_loadu_ps(x + i);
                __mmask16 m = _mm512_cmp_ps_mask(_mm512_abs_ps(v), vt, _CMP_NLT_UQ);
                _mm512_storeu_si512((void*)(out + c), _mm512_maskz_compress_epi32(m, idx));
                _mm512_storeu_ps(vals + c, _mm512_maskz_compress_ps(m, v));
                c += __builtin_popcount((unsigned)m);
                idx = _mm512_add_epi32(idx, step);
            }
        }
        sparse = (c - before) * SPARSE <= BLOCK;
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

/* mine[j] += how many of x[lo..hi) have !(|x| < ts[j]), for m thresholds, in one read (each
 * vector compared against every threshold while it is in a register). */
static void count_range(const float* x, int64_t lo, int64_t hi, const float* ts, int m, int64_t* mine) {
    int64_t i = lo;
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

struct chunk {
    const float* x;
    int64_t lo, hi;
    float t;
    int32_t* buf;
    float* vals;
    const float* guards;  /* m thresholds counted among the chunk's selected values */
    int m;
    int64_t count;
    int64_t guard_counts[MAX_THRESHOLDS];
};

static void run_chunk(struct chunk* ch) {
    float* vals = ch->vals ? ch->vals + ch->lo : 0;
    ch->count = pass_chunk(ch->x, ch->lo, ch->hi, ch->t, ch->buf + ch->lo, vals);
    for (int j = 0; j < ch->m; j++) ch->guard_counts[j] = 0;
    if (vals) count_range(vals, 0, ch->count, ch->guards, ch->m, ch->guard_counts);  /* in cache: just written */
}

static int64_t chunk_length(int64_t n, int threads) {
    return ((n + threads - 1) / threads + ALIGN - 1) / ALIGN * ALIGN;  /* ceil(n / threads), rounded up */
}

/* Chunk j of n elements cut in chunks of len: [*lo, *hi), empty past the end. */
static void chunk_range(int64_t n, int64_t len, int j, int64_t* lo, int64_t* hi) {
    *lo = j * len < n ? j * len : n;
    *hi = (j + 1) * len < n ? (j + 1) * len : n;
}

/* Chunk j's selected pairs (count of them, from part and part_vals) into out[0..want) (and
 * out_vals): all of them (want = count), or with keep_only those whose value has !(|v| < keep)
 * (want of them). The filter has no branch on the data (a raise keeps about half): every pair is
 * written, the next one over it when it fails; once want are written the rest go to a dummy, so
 * that a chunk never writes into the next chunk's part of out. */
static void gather_part(const int32_t* part, const float* part_vals, int64_t count, int keep_only, float keep,
                        int64_t* out, float* out_vals, int64_t want) {
    if (!keep_only || !part_vals) {
        for (int64_t i = 0; i < count; i++) out[i] = part[i];
        if (part_vals && out_vals) memcpy(out_vals, part_vals, (size_t)count * sizeof(float));
        return;
    }
    int64_t c = 0, dummy;
    float dummy_value;
    for (int64_t i = 0; i < count; i++) {
        int fits = c < want;
        *(fits ? out + c : &dummy) = part[i];
        *(fits && out_vals ? out_vals + c : &dummy_value) = part_vals[i];
        c += !(fabsf(part_vals[i]) < keep);
    }
}

/* The per-chunk counts select_f32 leaves in state: state[j] for chunk j's selection,
 * state[MAX_THREADS + j * MAX_THRESHOLDS + g] for its values passing guards[g]. */
#define STATE_LENGTH (MAX_THREADS * (1 + MAX_THRESHOLDS))
static int64_t chunk_want(const int64_t* state, int j, int chosen) {
    return chosen < 0 ? state[j] : state[MAX_THREADS + j * MAX_THRESHOLDS + chosen];
}

/* The pairs select_f32 left in buf (and vals), chunk after chunk (ascending), into out (and
 * out_vals when neither vals nor out_vals is NULL): all of them (chosen < 0), or those whose
 * value passes guards[chosen] = keep. out holds what select_f32 returned. For a caller whose out
 * was too small for select_f32 to gather into. */
void gather_chunks(const int32_t* buf, const float* vals, int64_t n, int threads, const int64_t* state,
                   int chosen, float keep, int64_t* out, float* out_vals) {
    int64_t len = chunk_length(n, threads < 1 ? 1 : threads), at = 0;
    for (int j = 0; j < threads; j++) {
        int64_t want = chunk_want(state, j, chosen);
        gather_part(buf + j * len, vals ? vals + j * len : 0, state[j], chosen >= 0, keep, out + at,
                    out_vals ? out_vals + at : 0, want);
        at += want;
    }
}

/* Positions of x[0..n) passing t, ascending, into out (their values into out_vals unless vals
 * is NULL), in one call: each chunk's positions go to buf[j * chunk_length] (values to vals
 * there); with vals, each chunk also counts its selected values passing each of guards[0..m) (a
 * guard's raised thresholds, ascending). When more than limit pass t and m > 0, the guard keeps
 * the pairs passing the first raise that lets at most limit pass (the last when none does);
 * *chosen <- its index, or -1. Returns how many pairs are kept; when they fit in cap, they are in
 * out (a second parallel loop writes each chunk's at its offset), else out is untouched and the
 * caller gathers them (gather_chunks) into room of its own. buf holds n int32, vals n float32,
 * state STATE_LENGTH int64. With OpenMP the chunks run on the process's OpenMP workers: torch's
 * own, already started (and often still spinning from torch's last parallel region), since the
 * process has loaded torch's libgomp before this library. */
int64_t select_f32(const float* x, int64_t n, float t, int32_t* buf, float* vals, int threads, int64_t* state,
                   const float* guards, int m, double limit, int64_t* out, float* out_vals, int64_t cap,
                   int* chosen) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    pthread_once(&pack_once, fill_pack_table);
#endif
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (m > MAX_THRESHOLDS) m = MAX_THRESHOLDS;
    if (!vals && n > 0) m = 0;  /* guards count values (an empty tensor has none to count) */
    struct chunk chunks[MAX_THREADS];
    int64_t len = chunk_length(n, threads);
    for (int j = 0; j < threads; j++) {
        int64_t lo, hi;
        chunk_range(n, len, j, &lo, &hi);
        chunks[j] = (struct chunk){.x = x, .lo = lo, .hi = hi, .t = t, .buf = buf, .vals = vals,
                                   .guards = guards, .m = m};
    }
#if defined(_OPENMP)
#pragma omp parallel for schedule(static, 1) num_threads(threads) if (threads > 1)
#endif
    for (int j = 0; j < threads; j++) run_chunk(&chunks[j]);
    int64_t total = 0, guard_totals[MAX_THRESHOLDS] = {0};
    for (int j = 0; j < threads; j++) {
        state[j] = chunks[j].count;
        total += chunks[j].count;
        for (int g = 0; g < m; g++) {
            state[MAX_THREADS + j * MAX_THRESHOLDS + g] = chunks[j].guard_counts[g];
            guard_totals[g] += chunks[j].guard_counts[g];
        }
    }
    int pick = -1;
    if (m > 0 && (double)total > limit) {
        pick = 0;
        while (pick < m - 1 && !((double)guard_totals[pick] <= limit)) pick++;
        total = guard_totals[pick];
    }
    *chosen = pick;
    if (total > cap) return total;
    int64_t offsets[MAX_THREADS], at = 0;
    for (int j = 0; j < threads; j++) {
        offsets[j] = at;
        at += chunk_want(state, j, pick);
    }
    float keep = pick >= 0 ? guards[pick] : 0.0f;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static, 1) num_threads(threads) if (threads > 1 && total >= 4096)
#endif
    for (int j = 0; j < threads; j++)
        gather_part(buf + chunks[j].lo, vals ? vals + chunks[j].lo : 0, chunks[j].count, pick >= 0, keep,
                    out + offsets[j], out_vals ? out_vals + offsets[j] : 0, chunk_want(state, j, pick));
    return total;
}

/* counts[j] <- how many of x[0..n) have !(|x| < ts[j]), for m thresholds, in one read of x. */
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
        for (int j = 0; j < m; j++) part[c][j] = 0;
        count_range(x, lo, hi, ts, m, part[c]);
    }
    for (int j = 0; j < m; j++) {
        counts[j] = 0;
        for (int c = 0; c < threads; c++) counts[j] += part[c][j];
    }
}
