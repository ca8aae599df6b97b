#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* glibc's libmvec has vector expf variants; <math.h> declares them only under -ffast-math,
   which would also set flush-to-zero for the whole process (crtfastmath), so say it here. */
#pragma omp declare simd notinbranch
float expf(float);

/* One (sequence, KV head) pair: G query rows q [G, D] against the keys lo <= t < hi listed
   block by block in `table`; s: G * (hi - lo) floats of scratch; o [G, DV]. Inlined with D
   and DV constant for the common head sizes, so the inner loops compile to straight vector code. */
static inline __attribute__((always_inline)) void pair(
        const float *restrict qi, const float *restrict k_pool, const float *restrict v_pool,
        const int64_t *restrict table, int64_t start, int64_t stop, int64_t h, float *restrict o,
        float *restrict s, const int64_t G, const int64_t D, const int64_t DV, int64_t NB, int64_t B,
        float scale) {
    const int64_t L = stop - start;
    memset(o, 0, sizeof(float) * G * DV);
    if (L <= 0) return;
    for (int64_t b = start / B; b * B < stop; ++b) {  /* scores: each key row read once for all G */
        const int64_t t0 = b * B > start ? b * B : start, t1 = (b + 1) * B < stop ? (b + 1) * B : stop;
        const float *restrict kb = k_pool + (h * NB + table[b]) * B * D;
        for (int64_t t = t0; t < t1; ++t) {
            const float *restrict kr = kb + (t - b * B) * D;
            for (int64_t g = 0; g < G; ++g) {
                const float *restrict qg = qi + g * D;
                float acc = 0.0f;
                #pragma omp simd reduction(+:acc)
                for (int64_t d = 0; d < D; ++d) acc += qg[d] * kr[d];
                s[g * L + (t - start)] = acc * scale;
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) {  /* softmax per query row */
        float *restrict sg = s + g * L;
        float m = sg[0], sum = 0.0f;
        for (int64_t j = 1; j < L; ++j) m = sg[j] > m ? sg[j] : m;
        #pragma omp simd reduction(+:sum)
        for (int64_t j = 0; j < L; ++j) { sg[j] = expf(sg[j] - m); sum += sg[j]; }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < L; ++j) sg[j] *= inv;
    }
    for (int64_t b = start / B; b * B < stop; ++b) {  /* the weighted sum of values */
        const int64_t t0 = b * B > start ? b * B : start, t1 = (b + 1) * B < stop ? (b + 1) * B : stop;
        const float *restrict vb = v_pool + (h * NB + table[b]) * B * DV;
        for (int64_t t = t0; t < t1; ++t) {
            const float *restrict vr = vb + (t - b * B) * DV;
            for (int64_t g = 0; g < G; ++g) {
                const float p = s[g * L + (t - start)];
                float *restrict og = o + g * DV;
                #pragma omp simd
                for (int64_t d = 0; d < DV; ++d) og[d] += p * vr[d];
            }
        }
    }
}

/* q [N, K, G, D]; k_pool [K, NB, B, D]; v_pool [K, NB, B, DV]; tables [N, T] (block ids);
   keys lo[n] <= t < hi[n] of sequence n attend; out [N, K, G, DV]. All contiguous. */
void paged_decode_attention(const float *restrict q, const float *restrict k_pool,
                            const float *restrict v_pool, const int64_t *restrict tables,
                            const int64_t *restrict lo, const int64_t *restrict hi, float *restrict out,
                            int64_t N, int64_t K, int64_t G, int64_t D, int64_t DV, int64_t NB,
                            int64_t B, int64_t T, float scale, int threads) {
    int64_t longest = 0;
    for (int64_t n = 0; n < N; ++n) longest = hi[n] - lo[n] > longest ? hi[n] - lo[n] : longest;
    #pragma omp parallel num_threads(threads)
    {
        float *s = (float *)malloc(sizeof(float) * (G * longest + 1));
        #pragma omp for schedule(dynamic, 8)
        for (int64_t i = 0; i < N * K; ++i) {
            const int64_t n = i / K, h = i % K;
            const float *qi = q + i * G * D;
            float *o = out + i * G * DV;
            const int64_t *table = tables + n * T;
            if (G == 4 && D == 64 && DV == 64)
                pair(qi, k_pool, v_pool, table, lo[n], hi[n], h, o, s, 4, 64, 64, NB, B, scale);
            else if (D == 64 && DV == 64)
                pair(qi, k_pool, v_pool, table, lo[n], hi[n], h, o, s, G, 64, 64, NB, B, scale);
            else if (D == 128 && DV == 128)
                pair(qi, k_pool, v_pool, table, lo[n], hi[n], h, o, s, G, 128, 128, NB, B, scale);
            else
                pair(qi, k_pool, v_pool, table, lo[n], hi[n], h, o, s, G, D, DV, NB, B, scale);
        }
        free(s);
    }
}
