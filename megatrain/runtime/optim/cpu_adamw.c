/* AdamW over flat fp32 rows in host memory, one pass, in the arithmetic of torch.optim.AdamW(fused=True) on the
 * CPU (so its results are bit-identical to that kernel's), without its extra traffic: torch's kernel writes the
 * scaled gradient back (4 more bytes per parameter) and the bf16 shadow of the new weights is a second pass
 * over the master row; here the gradient is only read and the shadow is written from registers.
 *
 * Three modes, by which rows they write:
 *   MT_FULL     master, exp_avg, exp_avg_sq       (read 16 bytes, write 12 per parameter)
 *   MT_MASTER   master only                       (read 16, write 4): the new moments are computed and dropped
 *   MT_MOMENTS  exp_avg and exp_avg_sq only       (read 12, write 8)
 * and mt_adamw_to: MT_FULL's update from one set of rows into another (read 16, write 12), the rows read left as
 * they were (an update made before the step's global norm, kept apart until the norm says it stands).
 * MT_MASTER then MT_MOMENTS with the same arguments leave exactly what MT_FULL leaves: the moments do not depend
 * on the master (decoupled weight decay), and both compute them with the same operations.
 *
 * Built with -ffp-contract=off, so that the only fused multiply-adds are those written (the ones torch's vector
 * loop makes), and without -ffast-math (sqrt and division stay correctly rounded).
 */
#include <math.h>
#include <time.h>
#include <stdint.h>
#include <string.h>

enum { MT_FULL = 0, MT_MASTER = 1, MT_MOMENTS = 2 };

typedef struct {
    float decay;     /* 1 - lr * weight_decay, applied to the master first (1: no decay) */
    float w1;        /* 1 - beta1: exp_avg.lerp_(grad, w1) */
    float beta2;
    float w2;        /* 1 - beta2 */
    float neg_step;  /* -lr / (1 - beta1^step) */
    float bc2_sqrt;  /* sqrt(1 - beta2^step) */
    float eps;
    float scale;     /* the gradient is divided by this as it is read (the clip factor's inverse); 0: not */
    int32_t v_fma;   /* exp_avg_sq's new value as fma(w2 * g, g, exp_avg_sq * beta2), as torch's vector loop computes
                        it from 2.13 on, rather than exp_avg_sq * beta2 + (w2 * g) * g (found by comparing) */
} mt_adamw_args;

/* round to nearest even, NaN to the quiet NaN c10::BFloat16 makes */
static inline uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0u : (uint16_t)r;
}

/* One element's new moments (m, v) and master (p) from its old values and its gradient as read (g: scaled).
 * The gradient's scale and the master's decay are applied unconditionally: x / 1 and x * 1 are x exactly, NaN
 * included. Elements are independent: any vector width and any split of [0, n) among threads gives the same bits.
 * (torch's remainder loop, the last n % width elements of a tensor, is compiled with other contractions; the
 * caller leaves those to torch.) */
static inline __attribute__((always_inline)) float new_moments(
        const float g, const float m0, const float v0, const mt_adamw_args a, const int big, const float coeff,
        float *v) {
    *v = a.v_fma ? fmaf(a.w2 * g, g, v0 * a.beta2) : v0 * a.beta2 + (a.w2 * g) * g;
    return fmaf(coeff, g - m0, big ? g : m0);
}

static inline __attribute__((always_inline)) float new_master(const float p0, const float m, const float v,
                                                              const mt_adamw_args a) {
    return p0 * a.decay + (a.neg_step * m) / (sqrtf(v) / a.bc2_sqrt + a.eps);
}

/* One element in place, specialised by the caller's constants (which rows it writes). */
static inline __attribute__((always_inline)) void element(
        float *restrict master, float *restrict exp_avg, float *restrict exp_avg_sq, const float *restrict grad,
        uint16_t *restrict out, int64_t i, const mt_adamw_args a, const int big, const float coeff,
        const float scale, const int write_master, const int write_moments, const int write_out) {
    float v;
    const float m = new_moments(grad[i] / scale, exp_avg[i], exp_avg_sq[i], a, big, coeff, &v);
    if (write_moments) {
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
    }
    if (write_master) {
        const float p = new_master(master[i], m, v, a);
        master[i] = p;
        if (write_out) out[i] = to_bf16(p);
    }
}

/* One element from the rows it reads into three other rows (every row written: MT_FULL's arithmetic). */
static inline __attribute__((always_inline)) void element_to(
        const float *restrict master, const float *restrict exp_avg, const float *restrict exp_avg_sq,
        const float *restrict grad, float *restrict to_master, float *restrict to_avg, float *restrict to_avg_sq,
        uint16_t *restrict out, int64_t i, const mt_adamw_args a, const int big, const float coeff,
        const float scale, const int write_out) {
    float v;
    const float m = new_moments(grad[i] / scale, exp_avg[i], exp_avg_sq[i], a, big, coeff, &v);
    to_avg[i] = m;
    to_avg_sq[i] = v;
    const float p = new_master(master[i], m, v, a);
    to_master[i] = p;
    if (write_out) out[i] = to_bf16(p);
}

/* torch's lerp: a small weight steps from the start (exp_avg), a large one back from the end (grad) */
static inline int lerp_big(const mt_adamw_args a) { return !(fabsf(a.w1) < 0.5f); }

/* what the gradient is divided by as it is read (1: no clip factor) */
static inline float grad_scale(const mt_adamw_args a) { return a.scale != 0.0f ? a.scale : 1.0f; }

/* One pass over [0, n). ``block`` 0: each thread takes one contiguous n / threads (a static schedule); > 0: threads
 * take runs of ``block`` elements as they come free (a dynamic schedule), so that a thread the OS runs late (the
 * host has as many cores as threads, and the thread issuing GPU work shares them) holds up only its last run, not a
 * sixteenth of the pass. */
static inline __attribute__((always_inline)) void pass(
        float *restrict master, float *restrict exp_avg, float *restrict exp_avg_sq, const float *restrict grad,
        uint16_t *restrict out, int64_t n, const mt_adamw_args a, int threads, int64_t block, const int write_master,
        const int write_moments, const int write_out) {
    const int big = lerp_big(a);
    const float coeff = big ? a.w1 - 1.0f : a.w1;
    const float scale = grad_scale(a);
    if (block > 0) {
#pragma omp parallel for simd schedule(dynamic, block) num_threads(threads)
        for (int64_t i = 0; i < n; i++)
            element(master, exp_avg, exp_avg_sq, grad, out, i, a, big, coeff, scale, write_master, write_moments,
                    write_out);
    } else {
#pragma omp parallel for simd schedule(static) num_threads(threads)
        for (int64_t i = 0; i < n; i++)
            element(master, exp_avg, exp_avg_sq, grad, out, i, a, big, coeff, scale, write_master, write_moments,
                    write_out);
    }
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Returns the seconds the pass took (what the caller's own clock adds to it is the call's overhead: with ctypes,
 * taking the GIL back). */
double mt_adamw(float *restrict master, float *restrict exp_avg, float *restrict exp_avg_sq,
                const float *restrict grad, uint16_t *restrict out, int64_t n, const mt_adamw_args *args,
                int mode, int threads, int64_t block) {
    const mt_adamw_args a = *args;
    if (threads < 1) threads = 1;
    const double t0 = now();
    if (mode == MT_MOMENTS)
        pass(master, exp_avg, exp_avg_sq, grad, out, n, a, threads, block, 0, 1, 0);
    else if (mode == MT_MASTER && out)
        pass(master, exp_avg, exp_avg_sq, grad, out, n, a, threads, block, 1, 0, 1);
    else if (mode == MT_MASTER)
        pass(master, exp_avg, exp_avg_sq, grad, out, n, a, threads, block, 1, 0, 0);
    else if (out)
        pass(master, exp_avg, exp_avg_sq, grad, out, n, a, threads, block, 1, 1, 1);
    else
        pass(master, exp_avg, exp_avg_sq, grad, out, n, a, threads, block, 1, 1, 0);
    return now() - t0;
}

static inline __attribute__((always_inline)) void pass_to(
        const float *restrict master, const float *restrict exp_avg, const float *restrict exp_avg_sq,
        const float *restrict grad, float *restrict to_master, float *restrict to_avg, float *restrict to_avg_sq,
        uint16_t *restrict out, int64_t n, const mt_adamw_args a, int threads, int64_t block, const int write_out) {
    const int big = lerp_big(a);
    const float coeff = big ? a.w1 - 1.0f : a.w1;
    const float scale = grad_scale(a);
    if (block > 0) {
#pragma omp parallel for simd schedule(dynamic, block) num_threads(threads)
        for (int64_t i = 0; i < n; i++)
            element_to(master, exp_avg, exp_avg_sq, grad, to_master, to_avg, to_avg_sq, out, i, a, big, coeff, scale,
                       write_out);
    } else {
#pragma omp parallel for simd schedule(static) num_threads(threads)
        for (int64_t i = 0; i < n; i++)
            element_to(master, exp_avg, exp_avg_sq, grad, to_master, to_avg, to_avg_sq, out, i, a, big, coeff, scale,
                       write_out);
    }
}

/* MT_FULL's update read from one set of rows and written to another (none of them the same memory): the rows
 * read stay as they were (read 16 bytes, write 12 per parameter, as in place). Returns the pass's seconds. */
double mt_adamw_to(const float *restrict master, const float *restrict exp_avg, const float *restrict exp_avg_sq,
                   const float *restrict grad, float *restrict to_master, float *restrict to_avg,
                   float *restrict to_avg_sq, uint16_t *restrict out, int64_t n, const mt_adamw_args *args,
                   int threads, int64_t block) {
    const mt_adamw_args a = *args;
    if (threads < 1) threads = 1;
    const double t0 = now();
    if (out)
        pass_to(master, exp_avg, exp_avg_sq, grad, to_master, to_avg, to_avg_sq, out, n, a, threads, block, 1);
    else
        pass_to(master, exp_avg, exp_avg_sq, grad, to_master, to_avg, to_avg_sq, out, n, a, threads, block, 0);
    return now() - t0;
}
