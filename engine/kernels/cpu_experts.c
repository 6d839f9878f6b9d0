/* A few MoE experts' FFN for one token on the CPU, reading the experts' weights from host RAM in
 * the kernel layout (repacked quantised planes).
 *
 * Why: during decoding the GPU reads the experts that are not in VRAM over PCIe; the CPU can
 * compute a share of those itself, from the same host bytes, at the same time. A job computes
 *
 *     y = sum_i wts[i] * down_i(SiLU(gate_i h) * (up_i h)),   i < *n
 *
 * which is what strata.engine.kernels.moe computes on the GPU. It runs from Python (ctypes,
 * which releases the GIL) or, during a GPU decode, on the pool's server thread, which answers the
 * jobs a GPU kernel posts through a mailbox in page-locked memory (strata_pool_serve, at the end).
 *
 * The format. strata/engine/quant/repack.py is the layout's one description (its module docstring
 * gives the byte and nibble order of every plane) and its dequantize_repacked is the exact
 * reference of every value; each decoder below says briefly what it reads. A matrix is `rows`
 * rows of `cols` elements; plane p of row r starts at
 *     matrix + planes[p] + r * (cols / elements per block) * (plane p's bytes per block)
 * except a fixed plane (a table: IQ4_XS's, IQ4_NL's and MXFP4's levels, the IQ3 grids), which
 * is once per matrix at matrix + planes[p] (the IQ3 grids' plane is not read here: the grid
 * types read float copies of the same values, strata_set_grids). The TYPES table below repeats each type's block and
 * plane sizes; strata_type_layout hands them to Python, which checks them against the types'
 * descriptions when it loads the library. A
 * "unit" is 32 consecutive elements of a row: in every 4-bit plane, byte 16 u + k holds element
 * 32 u + k in its low nibble and element 32 u + 16 + k in its high one.
 *
 * The arithmetic. A row's dot product keeps float32 partial sums in vectors of the machine's
 * width (GCC vector extensions, sized for what -march=native enables: see "vectors" below) and
 * adds their lanes at the row's end; the loops are plain elementwise vector code, so no float
 * reassociation (-ffast-math) is needed. The K-quants use the factored form: per unit,
 * scale * (q . x) - min * (sum of the unit's x), the unit sums computed once per input vector,
 * not once per row. Equal to "dequantise, then multiply" up to float rounding (the Python tests
 * bound the difference). On x86 with AVX2 or AVX-512BW the block types (the K-quants, the IQ4
 * types, MXFP4, IQ3_S, Q8_0 and Q4_0 to Q5_1; IQ3_XXS with AVX-512 VBMI) instead read their
 * input quantised to int8 (a unit of 32 on one scale, once per input vector: quantize_units) and
 * sum a group's weight-times-input products exactly in int32 (see "the integer kernels"):
 * 1.3-2.6 times the float kernels' speed, equal to "dequantise, then multiply" over the int8
 * input's values up to float rounding
 * (strata_int8_input says which; the tests check both). The results do not depend on the number
 * of threads: each row's arithmetic is the same whichever thread does it.
 *
 * The threads. A pool has `threads - 1` workers; the thread that runs a job is the last one.
 * Phase 1 splits the n * F rows of gate and up (each gate row and its up row in one pass over h)
 * into contiguous ranges, one per thread; a barrier; phase 2 splits the D rows of down (each
 * output row sums its n experts, weights applied). Idle workers spin for STRATA_SPIN_NS (during
 * decoding the next job comes within a fraction of a millisecond) and then sleep on a condition
 * variable, so an idle pool burns no CPU. No two jobs of one pool may run at the same time: the
 * caller guarantees it (one server, or one Python caller). A job may be run from any thread
 * (a pool thread excepted), one after another from different ones.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stddef.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "GGUF's fields are little-endian");

#define STRATA_MAX_PLANES 5 /* Q4_K and Q5_K have five planes (qs, sc, mn, d, dm) */

typedef struct {                /* one repacked matrix inside an expert's slot */
    int32_t qtype;              /* GGML type id */
    int32_t rows, cols;
    int64_t offset;             /* the matrix's byte offset inside the slot */
    int64_t planes[STRATA_MAX_PLANES]; /* each plane's byte offset from the matrix (unused: 0) */
} strata_mat;

typedef struct strata_pool strata_pool;

typedef struct {
    strata_mat gate, up, down; /* gate/up: F x D, down: D x F */
    int32_t D, F, kmax;
    const int32_t *n;     /* entries to compute (0..kmax), read at call time */
    const float *wts;     /* [kmax] routing weights */
    const int64_t *offs;  /* [kmax] expert i's slot is at base + offs[i] */
    int64_t base;
    const float *h;       /* [D] */
    float *y;             /* [D] */
    float *act;           /* [kmax * F] scratch */
    strata_pool *pool;
    /* gpt-oss's experts (bias_gate NULL: none): biases by expert id, the clamped SwiGLU */
    const int32_t *ids;   /* [kmax] expert i's id (the biases' row) */
    const float *bias_gate, *bias_up; /* [E * F] */
    const float *bias_down;           /* [E * D] */
    int32_t oai;          /* 1: g sigma(alpha g) (u + 1), g <= limit, |u| <= limit; 0: SiLU(g) u */
    float alpha, limit;
} strata_job;

/* GGML type ids (gguf.GGMLQuantizationType); the Python tests check them against gguf's. */
enum {
    T_F32 = 0,
    T_F16 = 1,
    T_Q4_0 = 2,
    T_Q4_1 = 3,
    T_Q5_0 = 6,
    T_Q5_1 = 7,
    T_Q8_0 = 8,
    T_Q2_K = 10,
    T_Q3_K = 11,
    T_Q4_K = 12,
    T_Q5_K = 13,
    T_Q6_K = 14,
    T_IQ3_XXS = 18,
    T_IQ4_NL = 20,
    T_IQ3_S = 21,
    T_IQ4_XS = 23,
    T_BF16 = 30,
    T_MXFP4 = 39,
};

#define INLINE static inline __attribute__((always_inline))
/* Vectors wider than the machine's registers are passed differently across ABIs; these are all
 * static and inlined, so no such call ever crosses a library boundary. */
#pragma GCC diagnostic ignored "-Wpsabi"

/* -- scalars (fields are read bytewise: a slot may sit at any address) ---------------------- */

INLINE uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

INLINE float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* IEEE half -> float, exact for every value and with no subnormal float on the way (a thread
 * may flush those to zero): a normal half's exponent rebased by 127 - 15; a subnormal one is its
 * mantissa times 2^-24; infinities and NaNs keep their mantissa under the all-ones exponent. */
INLINE float half(uint16_t h) {
    const uint32_t m = h & 0x7fffu, sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t r;
    if (m < 0x400u)
        r = f2u((float)m * 0x1p-24f);
    else if (m >= 0x7c00u)
        r = m << 13 | 0x7f800000u;
    else
        r = (m << 13) + (112u << 23);
    return u2f(sign | r);
}

#if defined(__F16C__)
#include <immintrin.h>
/* (the same values, NaNs aside: F16C quiets a signalling one) */
INLINE float ld_f16(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | p[1] << 8)); }
#else
INLINE float ld_f16(const uint8_t *p) { return half((uint16_t)(p[0] | p[1] << 8)); }
#endif

INLINE uint32_t ld_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* -- vectors (GCC vector extensions) --------------------------------------------------------
 * A vector holds H lanes: 16 where the machine has 512-bit registers (AVX-512), else 8 (AVX2's
 * 256 bits; narrower machines get the same code split by the compiler). In a unit's loop, lane k
 * of step j (j = 0, H, ..., 16 - H) takes the unit's elements j + k (x0) and 16 + j + k (x1),
 * so a 4-bit plane's H bytes at 16 u + j give both. */

#if defined(__AVX512F__)
#define H 16
#else
#define H 8
#endif

typedef float vf __attribute__((vector_size(4 * H)));
typedef int32_t vi __attribute__((vector_size(4 * H)));
typedef uint32_t vu __attribute__((vector_size(4 * H)));
typedef uint8_t vb __attribute__((vector_size(H)));
typedef int8_t vc __attribute__((vector_size(H)));
typedef uint16_t vw __attribute__((vector_size(H))); /* vb as 16-bit lanes, for shifts */
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint8_t v8b __attribute__((vector_size(8)));
typedef int8_t v8c __attribute__((vector_size(8)));

/* unaligned loads: a slot, and so a plane, may sit at any address */
typedef float uvf __attribute__((vector_size(4 * H), aligned(1), may_alias));
typedef float uv8f __attribute__((vector_size(32), aligned(1), may_alias));
typedef uint8_t uvb __attribute__((vector_size(H), aligned(1), may_alias));
typedef uint8_t uv8b __attribute__((vector_size(8), aligned(1), may_alias));
typedef uint16_t uvh __attribute__((vector_size(2 * H), aligned(1), may_alias));

INLINE vf ldf(const float *p) { return *(const uvf *)p; }
INLINE v8f ldf8(const float *p) { return *(const uv8f *)p; }
INLINE vb ldb(const uint8_t *p) { return *(const uvb *)p; }
/* Bytes that a conversion widens at once. GCC 12 turns a conversion fed straight by a load into
 * a load per byte; a byte operation in between ((x ^ 0x80) + 0x80 == x) keeps it one load. */
INLINE vc ldc(const uint8_t *p) { return (vc)(*(const uvb *)p ^ 0x80) + (int8_t)-128; }
INLINE v8b ldb8(const uint8_t *p) { return (*(const uv8b *)p ^ 0x80) + 0x80; }
INLINE v8c ldc8(const uint8_t *p) { return (v8c)(*(const uv8b *)p ^ 0x80) + (int8_t)-128; }

/* bytes -> floats, unsigned and signed */
INLINE vf b2f(vb v) { return __builtin_convertvector(__builtin_convertvector(v, vi), vf); }
INLINE vf c2f(vc v) { return __builtin_convertvector(__builtin_convertvector(v, vi), vf); }
INLINE v8f u8f(const uint8_t *p) {
    return __builtin_convertvector(__builtin_convertvector(ldb8(p), v8i), v8f);
}
INLINE v8f c8f(const uint8_t *p) {
    return __builtin_convertvector(__builtin_convertvector(ldc8(p), v8i), v8f);
}

/* Bytes shifted as 16-bit lanes: one instruction on x86, which has no byte shifts; the bits that
 * cross into the next byte must be masked off by the caller. */
INLINE vb shl16(vb v, int k) { return (vb)((vw)v << k); }
INLINE vb shr16(vb v, int k) { return (vb)((vw)v >> k); }

INLINE float hsum8(v8f v) {
    v4f a, b;
    memcpy(&a, &v, sizeof a);
    memcpy(&b, (const char *)&v + sizeof a, sizeof b);
    a += b;
    return (a[0] + a[2]) + (a[1] + a[3]);
}

INLINE float hsum(vf v) {
#if H == 16
    v8f a, b;
    memcpy(&a, &v, sizeof a);
    memcpy(&b, (const char *)&v + sizeof a, sizeof b);
    return hsum8(a + b);
#else
    return hsum8(v);
#endif
}

/* A row's partial sums: four independent chains (consecutive steps need not wait for each
 * other's additions), and the K-quants' min terms (lane u: unit u of every block). */
typedef struct {
    vf a[4];
    v8f m;
} acc_t;

/* An input quantised to int8 for the integer dot products (the kernels with I8 in TYPES): each
 * unit of 32 values as round(x / dx) with dx = max |x| / 127, its own; d holds dx once per group
 * of 16 (twice a unit) and s each group's sum of the quantised values, dx * sum q. With
 * LEVEL_SUMS, n holds -128 times each 4 values' sum (int32), in the order the level types' dot
 * products take x's bytes (x_nibbles: of each 64 values, 0-15, 32-47, 16-31, 48-63), so that
 * (level + 128), unsigned, times x starts from it and sums to level times x exactly: one
 * unsigned-by-signed VNNI dot product, not the sign moved onto x (level_dot). */
#if !defined(STRATA_FLOAT_ONLY) && H == 16 && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LEVEL_SUMS 1
#else
#define LEVEL_SUMS 0
#endif
typedef struct {
    const int8_t *q;  /* [n] */
    const float *d;   /* [n / 16] */
    const float *s;   /* [n / 16] */
    const int32_t *n; /* [n / 4] with LEVEL_SUMS, else NULL */
} xq_t;

/* the chain of unit u's step j */
#define CHAIN(u, j) (((u) * (16 / H) + (j) / H) & 3)

INLINE float acc_sum(const acc_t *c) {
    return hsum((c->a[0] + c->a[1]) + (c->a[2] + c->a[3])) - hsum8(c->m);
}

/* -- one block of a row against the input ----------------------------------------------------
 * p: the row's plane pointers, b: the block, x: the input row (the block's part starts at
 * x + b * elements per block), xs: the unit sums of x (xs[v] = x[32 v] + ... + x[32 v + 31]). */

/* Q4_K (256 elements; planes qs 128, sc 8, mn 8, d 2, dm 2): unit u's nibbles at qs[16 u..],
 * its 6-bit scale and min a byte each at sc[u], mn[u]; value = (d * sc) * q - dm * mn. */
INLINE void blk_q4_k(const uint8_t *const *p, int b, const float *x, const float *xs, acc_t *c) {
    const uint8_t *qs = p[0] + 128 * b;
    const float d = ld_f16(p[3] + 2 * b), dm = ld_f16(p[4] + 2 * b);
    const v8f ds = d * u8f(p[1] + 8 * b);
    c->m += (dm * u8f(p[2] + 8 * b)) * ldf8(xs + 8 * b);
    x += 256 * b;
#pragma GCC unroll 16
    for (int s = 0; s < 8 * 16 / H; s++) {
        const int u = s * H / 16, j = s * H % 16;
        const vb q = ldb(qs + 16 * u + j);
        const vf x0 = ldf(x + 32 * u + j), x1 = ldf(x + 32 * u + 16 + j);
        c->a[CHAIN(u, j)] += ds[u] * (b2f(q & 15) * x0 + b2f(shr16(q, 4) & 15) * x1);
    }
}

/* Q5_K (256; qs 128, qh 32, sc 8, mn 8, dd 4 = d then dmin): the low 4 bits as Q4_K's; the
 * fifth bit of element 32 u + i is bit i of the little-endian uint32 at qh[4 u], so bit i % 8 of
 * byte qh[4 u + i / 8]. With 16 lanes it is put in place in the bytes, beside the nibbles, before
 * they are widened: lane k of step j takes byte (j + k) / 8 (x0) or 2 + (j + k) / 8 (x1) of the
 * four, tests its bit k % 8 and keeps 16 where it is set (4.9 -> 5.2 GB/s a thread on AVX-512).
 * With 8 lanes the word is shifted per lane after widening (the byte form there: 4.0 -> 3.6). */
INLINE void blk_q5_k(const uint8_t *const *p, int b, const float *x, const float *xs, acc_t *c) {
    const uint8_t *qs = p[0] + 128 * b, *qh = p[1] + 32 * b;
    const float d = ld_f16(p[4] + 4 * b), dm = ld_f16(p[4] + 4 * b + 2);
    const v8f ds = d * u8f(p[2] + 8 * b);
    c->m += (dm * u8f(p[3] + 8 * b)) * ldf8(xs + 8 * b);
#if H == 16
    vb lanes, bit;
    for (int k = 0; k < H; k++) {
        lanes[k] = (uint8_t)k;
        bit[k] = (uint8_t)(1u << (k & 7));
    }
#else
    vu lanes;
    for (int k = 0; k < H; k++) lanes[k] = (uint32_t)k;
#endif
    x += 256 * b;
#pragma GCC unroll 16
    for (int s = 0; s < 8 * 16 / H; s++) {
        const int u = s * H / 16, j = s * H % 16;
        const vb q = ldb(qs + 16 * u + j);
        const vf x0 = ldf(x + 32 * u + j), x1 = ldf(x + 32 * u + 16 + j);
#if H == 16
        vb four = {0};
        memcpy(&four, qh + 4 * u, 4);
        const vb at = (vb)((lanes + (uint8_t)j) >> 3);
        const vb h0 = (vb)((__builtin_shuffle(four, at) & bit) != 0) & 16;
        const vb h1 = (vb)((__builtin_shuffle(four, (vb)(at + 2)) & bit) != 0) & 16;
        const vf flo = b2f((q & 15) | h0), fhi = b2f((shr16(q, 4) & 15) | h1);
#else
        const vu w = (vu){0} + ld_u32(qh + 4 * u);
        const vu lo = __builtin_convertvector(q & 15, vu) | ((w >> (lanes + j)) & 1) << 4;
        const vu hi = __builtin_convertvector(shr16(q, 4) & 15, vu) |
                      ((w >> (lanes + 16 + j)) & 1) << 4;
        const vf flo = __builtin_convertvector((vi)lo, vf);
        const vf fhi = __builtin_convertvector((vi)hi, vf);
#endif
        c->a[CHAIN(u, j)] += ds[u] * (flo * x0 + fhi * x1);
    }
}

/* Q6_K (256; ql 128, qh 64, sc 16 int8, d 2): the low 4 bits as Q4_K's nibbles; the high two
 * bits of element 64 g + 16 t + m are bits 2t of qh[16 g + m], so unit u (g = u / 2) finds them
 * at bit 4 (u % 2) for its first 16 elements and 2 more for its next 16; those two groups of 16
 * have the scales sc[u] and sc[8 + u]. value = (d * sc) * (q - 32). */
INLINE void blk_q6_k(const uint8_t *const *p, int b, const float *x, const float *xs, acc_t *c) {
    (void)xs;
    const uint8_t *ql = p[0] + 128 * b, *qh = p[1] + 64 * b;
    const float d = ld_f16(p[3] + 2 * b);
    const v8f sa = d * c8f(p[2] + 16 * b), sb = d * c8f(p[2] + 16 * b + 8);
    x += 256 * b;
#pragma GCC unroll 16
    for (int s = 0; s < 8 * 16 / H; s++) {
        const int u = s * H / 16, j = s * H % 16;
        const vb l = ldb(ql + 16 * u + j), h = ldb(qh + 16 * (u >> 1) + j);
        /* the high bits moved to bits 4 and 5 */
        const vb h0 = (u & 1 ? h : shl16(h, 4)) & 0x30;
        const vb h1 = (u & 1 ? shr16(h, 2) : shl16(h, 2)) & 0x30;
        const vc lo = (vc)((l & 15) | h0) - 32, hi = (vc)((shr16(l, 4) & 15) | h1) - 32;
        const vf x0 = ldf(x + 32 * u + j), x1 = ldf(x + 32 * u + 16 + j);
        c->a[CHAIN(u, j)] += sa[u] * (c2f(lo) * x0);
        c->a[CHAIN(u, j) ^ 1] += sb[u] * (c2f(hi) * x1);
    }
}

/* IQ4_XS (256; qs 128 level indices ordered as Q4_K's nibbles, sc 8 int8 = scale - 32, d 2, and
 * the fixed plane lv: the 16 float32 levels, once per matrix): value = (d * sc) * lv[q]. */
INLINE void blk_iq4_xs(const uint8_t *const *p, int b, const float *x, const float *xs,
                       acc_t *c) {
    (void)xs;
    const uint8_t *qs = p[0] + 128 * b;
    const v8f ds = ld_f16(p[2] + 2 * b) * c8f(p[1] + 8 * b);
    const float *lv = (const float *)p[3];
    x += 256 * b;
#if H == 16
    const vf lv0 = ldf(lv);
#define LEVELS(i) __builtin_shuffle(lv0, i)
#else
    const vf lv0 = ldf(lv), lv1 = ldf(lv + 8);
#define LEVELS(i) __builtin_shuffle(lv0, lv1, i)
#endif
#pragma GCC unroll 16
    for (int s = 0; s < 8 * 16 / H; s++) {
        const int u = s * H / 16, j = s * H % 16;
        const vb q = ldb(qs + 16 * u + j);
        const vi lo = __builtin_convertvector(q & 15, vi);
        const vi hi = __builtin_convertvector(shr16(q, 4) & 15, vi);
        const vf x0 = ldf(x + 32 * u + j), x1 = ldf(x + 32 * u + 16 + j);
        c->a[CHAIN(u, j)] += ds[u] * (LEVELS(lo) * x0 + LEVELS(hi) * x1);
    }
#undef LEVELS
}

/* Q8_0 (32; qs 32 int8, d 2): value = d * q. */
INLINE void blk_q8_0(const uint8_t *const *p, int b, const float *x, const float *xs, acc_t *c) {
    (void)xs;
    const uint8_t *q = p[0] + 32 * b;
    const float d = ld_f16(p[1] + 2 * b);
    x += 32 * b;
    vf t = {0};
#pragma GCC unroll 2
    for (int j = 0; j < 16; j += H)
        t += c2f(ldc(q + j)) * ldf(x + j) + c2f(ldc(q + 16 + j)) * ldf(x + 16 + j);
    c->a[0] += d * t;
}

/* Q4_0 (32; qs 16, d 2): element k is the low nibble of byte k, 16 + k its high one;
 * value = d * (q - 8). */
INLINE void blk_q4_0(const uint8_t *const *p, int b, const float *x, const float *xs, acc_t *c) {
    (void)xs;
    const uint8_t *q = p[0] + 16 * b;
    const float d = ld_f16(p[1] + 2 * b);
    x += 32 * b;
    vf t = {0};
#pragma GCC unroll 2
    for (int j = 0; j < 16; j += H) {
        const vb v = ldb(q + j);
        const vc lo = (vc)(v & 15) - 8, hi = (vc)(shr16(v, 4) & 15) - 8;
        t += c2f(lo) * ldf(x + j) + c2f(hi) * ldf(x + 16 + j);
    }
    c->a[0] += d * t;
}

/* Plain floats (one plane w, the file's bytes): a block is H elements, a row's tail scalar. */
INLINE void blk_f32(const uint8_t *const *p, int b, const float *x, const float *xs, acc_t *c) {
    (void)xs;
    c->a[0] += ldf((const float *)(p[0] + 4 * H * b)) * ldf(x + H * b);
}

INLINE void blk_f16(const uint8_t *const *p, int b, const float *x, const float *xs, acc_t *c) {
    (void)xs;
    const vu h = __builtin_convertvector(*(const uvh *)(p[0] + 2 * H * b), vu); /* half() */
    const vu m = h & 0x7fff;
    const vu sub = (vu)(m < 0x400), big = (vu)(m >= 0x7c00);
    const vu normal = (m << 13) + (112u << 23), special = (m << 13) | 0x7f800000;
    const vu small = (vu)(__builtin_convertvector((vi)m, vf) * 0x1p-24f);
    const vu r = (normal & ~(sub | big)) | (small & sub) | (special & big);
    c->a[0] += (vf)(r | (h & 0x8000) << 16) * ldf(x + H * b);
}

INLINE void blk_bf16(const uint8_t *const *p, int b, const float *x, const float *xs, acc_t *c) {
    (void)xs;
    const vu h = __builtin_convertvector(*(const uvh *)(p[0] + 2 * H * b), vu);
    c->a[0] += (vf)(h << 16) * ldf(x + H * b);
}

/* -- the gathered types (repack.GATHERED_TYPES): each plane holds the file's field in the file's
 * order; the decoders follow the types' descriptions (strata/engine/quant/legacy.py, kquants.py,
 * grids.py). */

/* 2^(e - 128) as a float, exactly (MXFP4's scale: ggml's e8m0 to float, halved). */
INLINE float e8m0_half(uint32_t e) {
    return u2f(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

/* The lanes' numbers 0..H-1, for picking each lane's bit of a word (and as a shuffle's). */
INLINE vu lane_ids(void) {
    vu lanes;
    for (int k = 0; k < H; k++) lanes[k] = (uint32_t)k;
    return lanes;
}

INLINE vi lane_ids_i(void) { return (vi)lane_ids(); }

/* Blocks of 32 (one unit): byte k of qs holds element k (low nibble) and 16 + k (high nibble);
 * xs[b] is the block's sum of x. Q4_1 (qs 16, d 2, m 2): value = d q + m, so the block adds
 * d (q . x) + m xs[b]. */
INLINE void blk_q4_1(const uint8_t *const *p, int b, const float *x, const float *xs, acc_t *c) {
    const uint8_t *q = p[0] + 16 * b;
    const float d = ld_f16(p[1] + 2 * b), m = ld_f16(p[2] + 2 * b);
    x += 32 * b;
    vf t = {0};
#pragma GCC unroll 2
    for (int j = 0; j < 16; j += H) {
        const vb v = ldb(q + j);
        t += b2f(v & 15) * ldf(x + j) + b2f(shr16(v, 4) & 15) * ldf(x + 16 + j);
    }
    c->a[0] += d * t;
    c->a[1][0] += m * xs[b];
}

/* Q5_0 / Q5_1 (qs 16, qh 4: bit i of the u32 is element i's fifth bit, d 2, Q5_1: m 2):
 * value = d (q - 16), or d q + m. */
INLINE vf q5_dot(const uint8_t *q, uint32_t h, const float *x) {
    const vu lanes = lane_ids(), w = (vu){0} + h;
    vf t = {0};
#pragma GCC unroll 2
    for (int j = 0; j < 16; j += H) {
        const vb v = ldb(q + j);
        const vu lo = __builtin_convertvector(v & 15, vu) | ((w >> (lanes + j)) & 1) << 4;
        const vu hi = __builtin_convertvector(shr16(v, 4) & 15, vu) |
                      ((w >> (lanes + 16 + j)) & 1) << 4;
        t += __builtin_convertvector((vi)lo, vf) * ldf(x + j) +
             __builtin_convertvector((vi)hi, vf) * ldf(x + 16 + j);
    }
    return t;
}

INLINE void blk_q5_0(const uint8_t *const *p, int b, const float *x, const float *xs, acc_t *c) {
    const float d = ld_f16(p[2] + 2 * b);
    c->a[0] += d * q5_dot(p[0] + 16 * b, ld_u32(p[1] + 4 * b), x + 32 * b);
    c->a[1][0] -= 16.0f * d * xs[b];
}

INLINE void blk_q5_1(const uint8_t *const *p, int b, const float *x, const float *xs, acc_t *c) {
    const float d = ld_f16(p[2] + 2 * b), m = ld_f16(p[3] + 2 * b);
    c->a[0] += d * q5_dot(p[0] + 16 * b, ld_u32(p[1] + 4 * b), x + 32 * b);
    c->a[1][0] += m * xs[b];
}

/* IQ4_NL / MXFP4 (qs 16, d 2 / e 1, lv: their 16 levels as floats, once per matrix):
 * value = d * lv[q] (MXFP4: d = 2^(e - 128)). */
INLINE vf lv_dot(const uint8_t *q, const float *lv, const float *x) {
#if H == 16
    const vf lv0 = ldf(lv);
#define LEVELS(i) __builtin_shuffle(lv0, i)
#else
    const vf lv0 = ldf(lv), lv1 = ldf(lv + 8);
#define LEVELS(i) __builtin_shuffle(lv0, lv1, i)
#endif
    vf t = {0};
#pragma GCC unroll 2
    for (int j = 0; j < 16; j += H) {
        const vb v = ldb(q + j);
        const vi lo = __builtin_convertvector(v & 15, vi);
        const vi hi = __builtin_convertvector(shr16(v, 4) & 15, vi);
        t += LEVELS(lo) * ldf(x + j) + LEVELS(hi) * ldf(x + 16 + j);
    }
#undef LEVELS
    return t;
}

INLINE void blk_iq4_nl(const uint8_t *const *p, int b, const float *x, const float *xs,
                       acc_t *c) {
    (void)xs;
    c->a[0] += ld_f16(p[1] + 2 * b) * lv_dot(p[0] + 16 * b, (const float *)p[2], x + 32 * b);
}

INLINE void blk_mxfp4(const uint8_t *const *p, int b, const float *x, const float *xs,
                      acc_t *c) {
    (void)xs;
    c->a[0] += e8m0_half(p[1][b]) * lv_dot(p[0] + 16 * b, (const float *)p[2], x + 32 * b);
}

/* Q2_K / Q3_K (256): unit u (32 elements) is bits 2 (u % 4) of qs[32 (u / 4) + k], k < 32; its
 * two groups of 16 have a scale each. Q2_K (qs 64, sc 16: low nibble scale, high nibble min,
 * d 2, dmin 2): value = (d sc) q - dmin mn. */
INLINE void blk_q2_k(const uint8_t *const *p, int b, const float *x, const float *xs, acc_t *c) {
    (void)xs;
    const uint8_t *qs = p[0] + 64 * b, *sc = p[1] + 16 * b;
    const float d = ld_f16(p[2] + 2 * b), dm = ld_f16(p[3] + 2 * b);
    /* A value's two bits go under the exponent of 1.0 (bits 22 and 21: the float 1 + q / 4,
     * no conversion), so group g's values are a[g] f - c[g] with a = 4 d sc and
     * c = a + dmin mn: one FMA an element after a shift and a mask. The 16 groups' a and c are
     * made as vectors. */
    float a[16], cm[16];
    for (int h = 0; h < 16; h += 8) {
        const v8i s = __builtin_convertvector(ldb8(sc + h), v8i); /* (x86 has no byte shift) */
        const v8f lo = __builtin_convertvector(s & 15, v8f);
        const v8f hi = __builtin_convertvector(s >> 4, v8f);
        const v8f av = (4.0f * d) * lo, cv = av + dm * hi;
        memcpy(a + h, &av, sizeof av);
        memcpy(cm + h, &cv, sizeof cv);
    }
    /* read back from memory, each a broadcast load (kept in registers, every scalar took a
     * shuffle and a broadcast) */
    __asm__("" : : "r"(a), "r"(cm) : "memory");
    x += 256 * b;
    /* byte k of qs[32 v..] holds element k of units 4 v .. 4 v + 3: widened once for the four */
#pragma GCC unroll 2
    for (int v = 0; v < 2; v++) {
#pragma GCC unroll 4
        for (int k = 0; k < 32; k += H) {
            const vu q = __builtin_convertvector((ldb(qs + 32 * v + k) ^ 0x80) + 0x80, vu);
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                const int u = 4 * v + t, g = 2 * u + k / 16;
                const vf f = (vf)(((q << (21 - 2 * t)) & (3u << 21)) | 0x3f800000u);
                c->a[CHAIN(u, k % 16)] += (a[g] * f - cm[g]) * ldf(x + 32 * u + k);
            }
        }
    }
}

/* Q3_K (qs 64, hm 32, sc 12, d 2): the third bit of element 32 u + k is bit u of hm[k]
 * (0: the value is q - 4); group g's 6-bit scale has its low 4 bits in nibble g / 8 of sc[g % 8]
 * and its high 2 in bits 2 (g / 4) of sc[8 + g % 4], minus 32. value = (d s) q. */
/* Q3_K's 16 scales as two vectors of 8 (not 16 scalar assemblies a block): groups 0-7 take the
 * low nibbles of sc[0..7], 8-15 the high; the high bits of group g are bits 2 (g / 4) of
 * sc[8 + g % 4] */
INLINE void q3_scales(const uint8_t *sc, v8i *s0, v8i *s1) {
    const v8i a = __builtin_convertvector(ldb8(sc), v8i);
    const uint8_t hb[8] = {sc[8], sc[9], sc[10], sc[11], sc[8], sc[9], sc[10], sc[11]};
    const v8i h = __builtin_convertvector(ldb8(hb), v8i);
    *s0 = ((a & 15) | ((h >> (v8i){0, 0, 0, 0, 2, 2, 2, 2}) & 3) << 4) - 32;
    *s1 = ((a >> 4) | ((h >> (v8i){4, 4, 4, 4, 6, 6, 6, 6}) & 3) << 4) - 32;
}

INLINE void blk_q3_k(const uint8_t *const *p, int b, const float *x, const float *xs, acc_t *c) {
    (void)xs;
    const uint8_t *qs = p[0] + 64 * b, *hm = p[1] + 32 * b;
    const float d = ld_f16(p[3] + 2 * b);
    v8i s0, s1;
    q3_scales(p[2] + 12 * b, &s0, &s1);
    /* As Q2_K's: a value's three bits (q, then the high bit) go under the exponent of 1.0, the
     * float f = 1 + (q | 4 h) / 8, and (q | 4 h) - 4 = 8 f - 12: group g's values are
     * sa[g] f - sb[g], sa = 8 d s and sb = 12 d s (exact: d s has 17 bits) */
    float sa[16], sb[16];
    const v8f f0 = d * __builtin_convertvector(s0, v8f), f1 = d * __builtin_convertvector(s1, v8f);
    const v8f a0 = 8.0f * f0, a1 = 8.0f * f1, b0 = 12.0f * f0, b1 = 12.0f * f1;
    memcpy(sa, &a0, sizeof a0);
    memcpy(sa + 8, &a1, sizeof a1);
    memcpy(sb, &b0, sizeof b0);
    memcpy(sb + 8, &b1, sizeof b1);
    __asm__("" : : "r"(sa), "r"(sb) : "memory"); /* broadcast loads, as Q2_K's */
    x += 256 * b;
    /* byte k of hm holds element k's high bit of every unit, of qs[32 v..] its two low bits of
     * units 4 v .. 4 v + 3: each widened once */
#pragma GCC unroll 4
    for (int k = 0; k < 32; k += H) {
        const vu hv = __builtin_convertvector((ldb(hm + k) ^ 0x80) + 0x80, vu);
#pragma GCC unroll 2
        for (int v = 0; v < 2; v++) {
            const vu q = __builtin_convertvector((ldb(qs + 32 * v + k) ^ 0x80) + 0x80, vu);
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                const int u = 4 * v + t, g = 2 * u + k / 16;
                const vu lo = (q << (20 - 2 * t)) & (3u << 20), hi = (hv << (22 - u)) & (1u << 22);
                const vf f = (vf)(lo | hi | 0x3f800000u);
                c->a[CHAIN(u, k % 16)] += (sa[g] * f - sb[g]) * ldf(x + 32 * u + k);
            }
        }
    }
}

/* -- the integer kernels ---------------------------------------------------------------------
 * Against the input quantised to int8 (xq_t), a group of 16 weights' small integers (unsigned;
 * the level types' signed, their signs moved onto the input) times its 16 input bytes is summed
 * exactly in int32 (x86's u8 x s8 dot products: AVX-512's VNNI, else AVX-512BW's or AVX2's
 * multiply-adds), then scaled once in float: the group's weight scale times the unit's input
 * scale. llama.cpp computes its CPU K-quants so (its q8_K input);
 * here a unit of 32 has its own scale, and the K-quants' mins and offsets take the quantised
 * input's group sums. Where none of those instructions is there, the float kernels stay. */
#if defined(STRATA_FLOAT_ONLY) /* (for measuring the two against each other) */
#define I8 0
#elif H == 16 && defined(__AVX512BW__)
#define I8 16
#elif H == 8 && defined(__AVX2__)
#define I8 8
#else
#define I8 0
#endif
/* the grid types' values from their codes in registers (AVX-512 VBMI's byte and word lookups),
 * not gathered: IQ3_S's integer kernel so, and IQ3_XXS's only so */
#if I8 == 16 && defined(__AVX512VBMI__)
#define GRID_CODES 1
#else
#define GRID_CODES 0
#endif

#if I8
#include <immintrin.h>

/* a register of bytes */
#if I8 == 16
typedef __m512i vbytes;
#else
typedef __m256i vbytes;
#endif

/* lane i: the sum of the products of bytes 4 i .. 4 i + 3 (u unsigned, s signed) */
#if I8 == 16
INLINE vi dot4(__m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
    return (vi)_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
    return (vi)_mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}
#else
INLINE v8i dot4(__m256i u, __m256i s) {
    return (v8i)_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#endif

/* x's bytes of units u and 4 + u of a 256-block side by side (Q2_K's and Q3_K's order) */
#if I8 == 16
INLINE __m512i x_pair(const int8_t *xq, int u) {
    const __m256i a = _mm256_loadu_si256((const __m256i *)(xq + 32 * u));
    const __m256i b = _mm256_loadu_si256((const __m256i *)(xq + 128 + 32 * u));
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}
#endif

/* Q2_K and Q3_K: their 2-bit planes hold units u and 4 + u at bits 2 u of the block's 64 bytes
 * (qs[0..31] and qs[32..63]). f[g]: group g's scale times its input's; a dot4 lane of unit u
 * covers 4 of a group's elements: with 16 lanes, lanes 0-7 are unit u's groups 2 u, 2 u + 1 and
 * 8-15 unit 4 + u's. `extra` adds bytes (Q3_K's third bits) to unit u's. */
#if I8 == 16
INLINE void units2(const uint8_t *qs, const int8_t *xq, vf f, const __m512i *extra, acc_t *c) {
    const __m512i bits = _mm512_loadu_si512(qs), three = _mm512_set1_epi8(3);
    const vi at = {0, 0, 0, 0, 1, 1, 1, 1, 8, 8, 8, 8, 9, 9, 9, 9};
#pragma GCC unroll 4
    for (int u = 0; u < 4; u++) {
        __m512i q = _mm512_and_si512(_mm512_srli_epi16(bits, 2 * u), three);
        if (extra) q = _mm512_or_si512(q, extra[u]);
        const vf fu = (vf)_mm512_permutexvar_ps((__m512i)(at + 2 * u), (__m512)f);
        c->a[u] += __builtin_convertvector(dot4(q, x_pair(xq, u)), vf) * fu;
    }
}
#else
INLINE void units2(const uint8_t *qs, const int8_t *xq, const v8f *f, const __m256i *extra,
                   acc_t *c) {
    const __m256i three = _mm256_set1_epi8(3);
    const v8i at = {0, 0, 0, 0, 1, 1, 1, 1};
#pragma GCC unroll 8
    for (int u = 0; u < 8; u++) {
        const __m256i bits = _mm256_loadu_si256((const __m256i *)(qs + 32 * (u / 4)));
        __m256i q = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * (u % 4)), three);
        if (extra) q = _mm256_or_si256(q, extra[u]);
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * u));
        const v8f fu = (v8f)_mm256_permutevar8x32_ps((__m256)f[u / 4], (__m256i)(at + 2 * (u % 4)));
        c->a[u & 3] += __builtin_convertvector(dot4(q, x), v8f) * fu;
    }
}
#endif

/* Q2_K: sum over a block = d sum_g sc[g] dx_g (q . xq)_g - dmin sum_g mn[g] s_g */
INLINE void blk_q2_k8(const uint8_t *const *p, int b, const xq_t *in, acc_t *c) {
    const uint8_t *qs = p[0] + 64 * b, *sc = p[1] + 16 * b;
    const float d = ld_f16(p[2] + 2 * b), dm = ld_f16(p[3] + 2 * b);
    const float *dx = in->d + 16 * b, *sx = in->s + 16 * b;
#if I8 == 16
    const vb s = ldb(sc);
    c->a[3] -= (dm * b2f(shr16(s, 4) & 15)) * ldf(sx);
    units2(qs, in->q + 256 * b, (d * b2f(s & 15)) * ldf(dx), NULL, c);
#else
    /* (the nibbles split as int32 lanes: AVX2 has no byte shift, and GCC made one of each) */
    const v8i s0 = __builtin_convertvector(ldb8(sc), v8i);
    const v8i s1 = __builtin_convertvector(ldb8(sc + 8), v8i);
    c->a[2] -= (dm * __builtin_convertvector(s0 >> 4, v8f)) * ldf(sx);
    c->a[3] -= (dm * __builtin_convertvector(s1 >> 4, v8f)) * ldf(sx + 8);
    const v8f f[2] = {(d * __builtin_convertvector(s0 & 15, v8f)) * ldf(dx),
                      (d * __builtin_convertvector(s1 & 15, v8f)) * ldf(dx + 8)};
    units2(qs, in->q + 256 * b, f, NULL, c);
#endif
}

/* The 4-bit planes (Q4_K's, Q6_K's low bits): a unit's 16 bytes hold its elements 0-15 in their
 * low nibbles and 16-31 in their high. With 16 lanes a step takes units 2 w and 2 w + 1: their
 * values as 64 bytes, elements 0-15 of each, then 16-31 of each (chunk c of 16 bytes, dot4's
 * lanes 4 c .. 4 c + 3, is of group 4 w + (0, 2, 1, 3)[c]), beside x's bytes in that order. */
#if I8 == 16
INLINE __m512i nibbles(const uint8_t *q) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)q), m = _mm256_set1_epi8(15);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, m)),
                              _mm256_and_si256(_mm256_srli_epi16(v, 4), m), 1);
}

INLINE __m512i x_nibbles(const int8_t *xq, int w) {
    const __m512i v = _mm512_loadu_si512(xq + 64 * w);
    return _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0));
}

/* xq_t's n from lane `at` on (NULL without LEVEL_SUMS: level_dot reads none) */
INLINE const int32_t *level_sums(const xq_t *in, int at) {
    return LEVEL_SUMS ? in->n + at : NULL;
}

#if LEVEL_SUMS
/* A level type's values (levels looked up as levels8 made them) times x's bytes at n's sums
 * (xq_t): (level + 128) unsigned times x, started from -128 times x's sums, exactly level times
 * x in int32 (VNNI's sum of 4 products does not saturate) */
INLINE vi level_dot(__m512i w, __m512i x, const int32_t *n) {
    return (vi)_mm512_dpbusd_epi32(_mm512_loadu_si512(n), w, x);
}
#else
/* signed by signed: |w| times x with w's sign (|w|, |x| <= 127: a pair's sum fits int16) */
INLINE vi level_dot(__m512i w, __m512i x, const int32_t *n) {
    (void)n;
    const __mmask64 neg = _mm512_movepi8_mask(w);
    return dot4(_mm512_abs_epi8(w), _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x));
}
#endif

/* a step's groups: chunk c of the 64 bytes is of group 4 w + (0, 2, 1, 3)[c]; q unsigned, or
 * with LV levels (the level types: level_dot, at the step's sums of x n) */
INLINE void units4(__m512i q, const int8_t *xq, int w, vf f, int lv, const int32_t *n,
                   acc_t *c) {
    const vi at = {0, 0, 0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 3, 3, 3, 3};
    const vf fw = (vf)_mm512_permutexvar_ps((__m512i)(at + 4 * w), (__m512)f);
    const __m512i x = x_nibbles(xq, w);
    c->a[w] += __builtin_convertvector(lv ? level_dot(q, x, n) : dot4(q, x), vf) * fw;
}

/* 16 levels (floats holding integers of int8's range) as bytes, in each 128-bit lane: with
 * LEVEL_SUMS plus 128, unsigned (level_dot) */
INLINE __m512i levels8(const float *lv) {
    const __m512i b =
        _mm512_broadcast_i32x4(_mm512_cvtepi32_epi8(_mm512_cvttps_epi32(_mm512_loadu_ps(lv))));
    return LEVEL_SUMS ? _mm512_xor_si512(b, _mm512_set1_epi8((char)0x80)) : b;
}

INLINE __m512i lookup(__m512i levels, __m512i idx) { return _mm512_shuffle_epi8(levels, idx); }

/* each of 8 values twice: lanes 2 u and 2 u + 1 take u's */
INLINE vf twice(v8f v) {
    const vi at = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
    return (vf)_mm512_permutexvar_ps((__m512i)at, _mm512_castps256_ps512((__m256)v));
}
#else
INLINE __m256i nibbles(const uint8_t *q) {
    const __m128i v = _mm_loadu_si128((const __m128i *)q), m = _mm_set1_epi8(15);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(v, m)),
                                   _mm_and_si128(_mm_srli_epi16(v, 4), m), 1);
}

INLINE v8i sdot4(__m256i w, __m256i x) {
    return dot4(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

INLINE __m256i levels8(const float *lv) {
    const __m256i a = _mm256_cvttps_epi32(_mm256_loadu_ps(lv));
    const __m256i b = _mm256_cvttps_epi32(_mm256_loadu_ps(lv + 8));
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    const __m128i t = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    return _mm256_broadcastsi128_si256(t);
}

INLINE __m256i lookup(__m256i levels, __m256i idx) { return _mm256_shuffle_epi8(levels, idx); }
#endif

/* Fifth bits (Q5_K's, Q5_0's, Q5_1's: bit k of a unit's word is its element k's) as 16 added to
 * the nibbles: with 16 lanes two units' words (h0, h1) in the nibbles' chunk order, elements 0-15
 * of each, then 16-31 of each; with 8 a unit's, its lane k taking byte k / 8 and testing its bit
 * k % 8 */
#if I8 == 16
INLINE __m512i add_fifth(__m512i q, uint64_t h0, uint64_t h1) {
    const uint64_t k = (h0 & 0xffff) | (h1 & 0xffff) << 16 | (h0 >> 16) << 32 | (h1 >> 16) << 48;
    return _mm512_mask_add_epi8(q, (__mmask64)k, q, _mm512_set1_epi8(16));
}
#else
INLINE __m256i add_fifth(__m256i q, uint32_t h) {
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                                          2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
    const __m256i by = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h), pick);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(by, bit), bit);
    return _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
}
#endif

/* Q4_K: a block's sum is sum_u d sc[u] dx_u (q . xq)_u - dm sum_u mn[u] (s_2u + s_2u+1); Q5_K's
 * the same with q's fifth bit (qh; NULL: Q4_K): bit i of the little-endian uint32 at qh[4 u] is
 * element i of unit u's */
INLINE void k45_8(const uint8_t *qs, const uint8_t *qh, float d, float dm, const uint8_t *sc,
                  const uint8_t *mn, const xq_t *in, int b, acc_t *c) {
    const float *dx = in->d + 16 * b, *sx = in->s + 16 * b;
    const int8_t *xq = in->q + 256 * b;
    const v8f s = d * u8f(sc), m = dm * u8f(mn);
#if I8 == 16
    c->a[0] -= twice(m) * ldf(sx);
    const vf f = twice(s) * ldf(dx);
#pragma GCC unroll 4
    for (int w = 0; w < 4; w++) {
        __m512i q = nibbles(qs + 32 * w);
        if (qh) q = add_fifth(q, ld_u32(qh + 8 * w), ld_u32(qh + 8 * w + 4)); /* units 2 w, +1 */
        units4(q, xq, w, f, 0, NULL, c);
    }
#else
    const v8i lo = {0, 0, 1, 1, 2, 2, 3, 3}, hi = lo + 4;
    c->a[0] -= __builtin_shuffle(m, lo) * ldf(sx);
    c->a[1] -= __builtin_shuffle(m, hi) * ldf(sx + 8);
#pragma GCC unroll 8
    for (int u = 0; u < 8; u++) {
        __m256i q = nibbles(qs + 16 * u);
        if (qh) q = add_fifth(q, ld_u32(qh + 4 * u));
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * u));
        const v8f t = __builtin_convertvector(dot4(q, x), v8f);
        c->a[u & 3] += t * (s[u] * dx[2 * u]);
    }
#endif
}

INLINE void blk_q4_k8(const uint8_t *const *p, int b, const xq_t *in, acc_t *c) {
    k45_8(p[0] + 128 * b, NULL, ld_f16(p[3] + 2 * b), ld_f16(p[4] + 2 * b), p[1] + 8 * b,
          p[2] + 8 * b, in, b, c);
}

/* (Q5_K's planes: qs 128, qh 32, sc 8, mn 8, dd 4) */
INLINE void blk_q5_k8(const uint8_t *const *p, int b, const xq_t *in, acc_t *c) {
    k45_8(p[0] + 128 * b, p[1] + 32 * b, ld_f16(p[4] + 4 * b), ld_f16(p[4] + 4 * b + 2),
          p[2] + 8 * b, p[3] + 8 * b, in, b, c);
}

/* Q6_K: values q - 32, q of 6 bits (the 4-bit plane's, the high two from qh: bits 4 (u % 2) and
 * 4 (u % 2) + 2 of qh[16 (u / 2) + k] for unit u's elements k and 16 + k); group g = 2 u + half
 * has the int8 scale sc[u + 8 half]. A block's sum: d sum_g sc_g (dx_g (q . xq)_g - 32 s_g). */
INLINE void blk_q6_k8(const uint8_t *const *p, int b, const xq_t *in, acc_t *c) {
    const uint8_t *ql = p[0] + 128 * b, *qh = p[1] + 64 * b;
    const float d = ld_f16(p[3] + 2 * b);
    const float *dx = in->d + 16 * b, *sx = in->s + 16 * b;
    const int8_t *xq = in->q + 256 * b;
    const v8f sa = d * c8f(p[2] + 16 * b), sb = d * c8f(p[2] + 16 * b + 8);
#if I8 == 16
    /* group 2 u takes sa[u], 2 u + 1 sb[u] */
    const vi mix = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
    const vf g = (vf)_mm512_permutex2var_ps(_mm512_castps256_ps512((__m256)sa), (__m512i)mix,
                                            _mm512_castps256_ps512((__m256)sb));
    c->a[0] -= (32.0f * g) * ldf(sx);
    const vf f = g * ldf(dx);
    /* the high bits of units 2 w (elements 0-15, 16-31: qh's bits 0-1, 2-3) and 2 w + 1 (bits
     * 4-5, 6-7) moved to bits 4-5, in units4's chunk order: shifted left 4, 0, 2, right 2 */
    /* (16-bit lanes, chunk c is lanes 8 c .. 8 c + 7) */
    const __m512i left = _mm512_set_epi64(0, 0, 0x0002000200020002, 0x0002000200020002, 0, 0,
                                          0x0004000400040004, 0x0004000400040004);
    const __m512i right = _mm512_set_epi64(0x0002000200020002, 0x0002000200020002, 0, 0, 0, 0, 0,
                                           0);
    const __m512i m = _mm512_set1_epi8(0x30);
#pragma GCC unroll 4
    for (int w = 0; w < 4; w++) {
        const __m128i h4 = _mm_loadu_si128((const __m128i *)(qh + 16 * w));
        const __m512i h = _mm512_sllv_epi16(_mm512_broadcast_i32x4(h4), left);
        const __m512i hb = _mm512_and_si512(_mm512_srlv_epi16(h, right), m);
        units4(_mm512_or_si512(nibbles(ql + 32 * w), hb), xq, w, f, 0, NULL, c);
    }
#else
    const v8i ab = {0, 8, 1, 9, 2, 10, 3, 11};
    const v8f g0 = __builtin_shuffle(sa, sb, ab), g1 = __builtin_shuffle(sa, sb, ab + 4);
    c->a[0] -= (32.0f * g0) * ldf(sx);
    c->a[1] -= (32.0f * g1) * ldf(sx + 8);
    const __m256i m = _mm256_set1_epi8(0x30);
#pragma GCC unroll 8
    for (int u = 0; u < 8; u++) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(qh + 16 * (u / 2)));
        const __m128i h0 = u & 1 ? h : _mm_slli_epi16(h, 4);
        const __m128i h1 = u & 1 ? _mm_srli_epi16(h, 2) : _mm_slli_epi16(h, 2);
        const __m256i hb = _mm256_and_si256(
            _mm256_inserti128_si256(_mm256_castsi128_si256(h0), h1, 1), m);
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * u));
        const __m256i q = _mm256_or_si256(nibbles(ql + 16 * u), hb);
        /* lanes 0-3: group 2 u (sa[u]), 4-7: 2 u + 1 (sb[u]) */
        const v8f fu = {sa[u], sa[u], sa[u], sa[u], sb[u], sb[u], sb[u], sb[u]};
        c->a[u & 3] += __builtin_convertvector(dot4(q, x), v8f) * (fu * dx[2 * u]);
    }
#endif
}

/* IQ4_XS: as Q4_K's units, each value a level (lv, int8 integers as floats: their bytes looked
 * up by the nibble), the unit's scale d sc[u] */
INLINE void blk_iq4_xs8(const uint8_t *const *p, int b, const xq_t *in, acc_t *c) {
    const uint8_t *qs = p[0] + 128 * b;
    const v8f ds = ld_f16(p[2] + 2 * b) * c8f(p[1] + 8 * b);
    const float *dx = in->d + 16 * b;
    const int8_t *xq = in->q + 256 * b;
    const vbytes lv = levels8((const float *)p[3]);
#if I8 == 16
    const vf f = twice(ds) * ldf(dx);
#pragma GCC unroll 4
    for (int w = 0; w < 4; w++)
        units4(lookup(lv, nibbles(qs + 32 * w)), xq, w, f, 1, level_sums(in, 64 * b + 16 * w), c);
#else
#pragma GCC unroll 8
    for (int u = 0; u < 8; u++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * u));
        const v8i t = sdot4(lookup(lv, nibbles(qs + 16 * u)), x);
        c->a[u & 3] += __builtin_convertvector(t, v8f) * (ds[u] * dx[2 * u]);
    }
#endif
}

/* IQ4_NL and MXFP4 (blocks of 32, one unit: qs 16, d 2 / e 1, lv), two blocks at a time (b: the
 * pair): each block's scale (d, or MXFP4's 2^(e - 128)) times its unit's dx. Into fixed chains:
 * one picked by b (not known when compiling) kept the sums in memory (MXFP4 8.4 -> 9.6 GB/s). */
INLINE void pair_levels(const uint8_t *qs, const float *lv, float s0, float s1, const xq_t *in,
                        int b, acc_t *c) {
    const int8_t *xq = in->q + 64 * b;
#if I8 == 16
    const vf f = (vf)_mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(s0), _mm512_set1_ps(s1));
    const __m512i w = lookup(levels8(lv), nibbles(qs));
    const vi t = level_dot(w, x_nibbles(xq, 0), level_sums(in, 16 * b));
    c->a[0] += __builtin_convertvector(t, vf) * f;
#else
    const __m256i t = levels8(lv);
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)xq);
    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + 32));
    c->a[0] += __builtin_convertvector(sdot4(lookup(t, nibbles(qs)), x0), v8f) * s0;
    c->a[1] += __builtin_convertvector(sdot4(lookup(t, nibbles(qs + 16)), x1), v8f) * s1;
#endif
}

INLINE void blk_iq4_nl8(const uint8_t *const *p, int b, const xq_t *in, acc_t *c) {
    const float *dx = in->d + 4 * b;
    const float s0 = ld_f16(p[1] + 4 * b) * dx[0], s1 = ld_f16(p[1] + 4 * b + 2) * dx[2];
    pair_levels(p[0] + 32 * b, (const float *)p[2], s0, s1, in, b, c);
}

INLINE void blk_mxfp48(const uint8_t *const *p, int b, const xq_t *in, acc_t *c) {
    const float *dx = in->d + 4 * b;
    const float s0 = e8m0_half(p[1][2 * b]) * dx[0], s1 = e8m0_half(p[1][2 * b + 1]) * dx[2];
    pair_levels(p[0] + 32 * b, (const float *)p[2], s0, s1, in, b, c);
}

/* The 32-element types of one scale a block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), two blocks at a time
 * (b: the pair), as IQ4_NL's: a block's sum is d dx (q . xq) plus its offset times the block's
 * input sum: Q4_0's -8 d and Q5_0's -16 d (off: 8, 16), Q4_1's and Q5_1's m (mins: the two; else
 * NULL). With LEVEL_SUMS those come from xq_t's n: -8 and -16 times x's sums of 4 are n / 16 and
 * n / 8, where the integer sums start; the mins' sums in float, as vectors. Else from the group
 * sums (pair_offsets). qh: Q5's fifth bits (bit k of a block's word: element k), NULL for Q4;
 * d0, d1: the two blocks' d. */
INLINE void pair_offsets(float o0, float o1, const xq_t *in, int b, acc_t *c);
INLINE void pair_nibbles(const uint8_t *qs, const uint8_t *qh, float d0, float d1, int off,
                         const float *mins, const xq_t *in, int b, acc_t *c) {
    const float *dx = in->d + 4 * b;
    const int8_t *xq = in->q + 64 * b;
#if I8 == 16
    __m512i q = nibbles(qs);
    if (qh) q = add_fifth(q, ld_u32(qh), ld_u32(qh + 4));
    const vf f = (vf)_mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(d0 * dx[0]),
                                          _mm512_set1_ps(d1 * dx[2]));
#if LEVEL_SUMS
    const __m512i n = _mm512_loadu_si512(in->n + 16 * b);
    const __m512i start = off == 8    ? _mm512_srai_epi32(n, 4)
                          : off == 16 ? _mm512_srai_epi32(n, 3)
                                      : _mm512_setzero_si512();
    const vi t = (vi)_mm512_dpbusd_epi32(start, q, x_nibbles(xq, 0));
    c->a[0] += __builtin_convertvector(t, vf) * f;
    if (mins) {
        const vf g = (vf)_mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(mins[0] * dx[0]),
                                              _mm512_set1_ps(mins[1] * dx[2]));
        c->a[1] += __builtin_convertvector((vi)n, vf) * (g * (-1.0f / 128));
    }
    return;
#else
    c->a[0] += __builtin_convertvector(dot4(q, x_nibbles(xq, 0)), vf) * f;
#endif
#else
    for (int k = 0; k < 2; k++) {
        __m256i q = nibbles(qs + 16 * k);
        if (qh) q = add_fifth(q, ld_u32(qh + 4 * k));
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * k));
        c->a[k] += __builtin_convertvector(dot4(q, x), v8f) * ((k ? d1 : d0) * dx[2 * k]);
    }
#endif
    if (mins)
        pair_offsets(mins[0], mins[1], in, b, c);
    else
        pair_offsets(-off * d0, -off * d1, in, b, c);
}

/* a pair's offsets: o0, o1 times each block's input sum */
INLINE void pair_offsets(float o0, float o1, const xq_t *in, int b, acc_t *c) {
    const float *s = in->s + 4 * b;
    c->a[2][0] += o0 * (s[0] + s[1]) + o1 * (s[2] + s[3]);
}

INLINE void blk_q4_08(const uint8_t *const *p, int b, const xq_t *in, acc_t *c) {
    const float d0 = ld_f16(p[1] + 4 * b), d1 = ld_f16(p[1] + 4 * b + 2);
    pair_nibbles(p[0] + 32 * b, NULL, d0, d1, 8, NULL, in, b, c);
}

INLINE void blk_q4_18(const uint8_t *const *p, int b, const xq_t *in, acc_t *c) {
    const float d0 = ld_f16(p[1] + 4 * b), d1 = ld_f16(p[1] + 4 * b + 2);
    const float m[2] = {ld_f16(p[2] + 4 * b), ld_f16(p[2] + 4 * b + 2)};
    pair_nibbles(p[0] + 32 * b, NULL, d0, d1, 0, m, in, b, c);
}

INLINE void blk_q5_08(const uint8_t *const *p, int b, const xq_t *in, acc_t *c) {
    const float d0 = ld_f16(p[2] + 4 * b), d1 = ld_f16(p[2] + 4 * b + 2);
    pair_nibbles(p[0] + 32 * b, p[1] + 8 * b, d0, d1, 16, NULL, in, b, c);
}

INLINE void blk_q5_18(const uint8_t *const *p, int b, const xq_t *in, acc_t *c) {
    const float d0 = ld_f16(p[2] + 4 * b), d1 = ld_f16(p[2] + 4 * b + 2);
    const float m[2] = {ld_f16(p[3] + 4 * b), ld_f16(p[3] + 4 * b + 2)};
    pair_nibbles(p[0] + 32 * b, p[1] + 8 * b, d0, d1, 0, m, in, b, c);
}

/* Q8_0: its signed bytes times x's in their order (|w| times x with w's sign) */
INLINE void blk_q8_08(const uint8_t *const *p, int b, const xq_t *in, acc_t *c) {
    const float *dx = in->d + 4 * b;
    const float d0 = ld_f16(p[1] + 4 * b) * dx[0], d1 = ld_f16(p[1] + 4 * b + 2) * dx[2];
    const uint8_t *w = p[0] + 64 * b;
    const int8_t *xq = in->q + 64 * b;
#if I8 == 16
    const __m512i v = _mm512_loadu_si512(w), x = _mm512_loadu_si512(xq);
    const __m512i sx = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(v), _mm512_setzero_si512(), x);
    const vf f = (vf)_mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d0), _mm512_set1_ps(d1));
    c->a[0] += __builtin_convertvector(dot4(_mm512_abs_epi8(v), sx), vf) * f;
#else
    for (int k = 0; k < 2; k++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 32 * k));
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * k));
        c->a[k] += __builtin_convertvector(sdot4(v, x), v8f) * (k ? d1 : d0);
    }
#endif
}

/* Q3_K: its values are (q | 4 h) - 4 (h the third bit), so a block's sum is
 * d sum_g s[g] (dx_g ((q | 4 h) . xq)_g - 4 s_g): the third bits join the two as bytes of 4 */
INLINE void blk_q3_k8(const uint8_t *const *p, int b, const xq_t *in, acc_t *c) {
    const uint8_t *qs = p[0] + 64 * b, *hm = p[1] + 32 * b;
    const float d = ld_f16(p[3] + 2 * b);
    const float *dx = in->d + 16 * b, *sx = in->s + 16 * b;
    v8i s0, s1;
    q3_scales(p[2] + 12 * b, &s0, &s1);
    const v8f f0 = d * __builtin_convertvector(s0, v8f), f1 = d * __builtin_convertvector(s1, v8f);
#if I8 == 16
    vf f;
    memcpy(&f, &f0, sizeof f0);
    memcpy((char *)&f + sizeof f0, &f1, sizeof f1);
    c->a[3] -= (4.0f * f) * ldf(sx);
    /* unit u's third bits are bit u of hm[k]: its bytes 0-31 for unit u, beside those of unit
     * 4 + u (bits 4 + u: the second copy shifted down by 4), each moved to bit 2 */
    const __m256i h = _mm256_loadu_si256((const __m256i *)hm);
    const __m512i hh = _mm512_inserti64x4(
        _mm512_castsi256_si512(h),
        _mm256_and_si256(_mm256_srli_epi16(h, 4), _mm256_set1_epi8(15)), 1);
    const __m512i four = _mm512_set1_epi8(4);
    const __m512i extra[4] = {
        _mm512_and_si512(_mm512_slli_epi16(hh, 2), four),
        _mm512_and_si512(_mm512_slli_epi16(hh, 1), four),
        _mm512_and_si512(hh, four),
        _mm512_and_si512(_mm512_srli_epi16(hh, 1), four),
    };
    units2(qs, in->q + 256 * b, f * ldf(dx), extra, c);
#else
    c->a[2] -= (4.0f * f0) * ldf(sx);
    c->a[3] -= (4.0f * f1) * ldf(sx + 8);
    const __m256i h = _mm256_loadu_si256((const __m256i *)hm), four = _mm256_set1_epi8(4);
    __m256i extra[8];
    for (int u = 0; u < 8; u++)
        extra[u] = _mm256_and_si256(u <= 2 ? _mm256_slli_epi16(h, 2 - u)
                                           : _mm256_srli_epi16(h, u - 2), four);
    const v8f f[2] = {f0 * ldf(dx), f1 * ldf(dx + 8)};
    units2(qs, in->q + 256 * b, f, extra, c);
#endif
}
#endif /* I8 */

/* The grid types: four elements are one grid row, eight share a sign byte. The rows are read
 * from float32 copies of the grids (strata_set_grids, from the types' descriptions at load,
 * once per process: every matrix's own table plane holds the same bytes), 16 bytes a row, so
 * eight values are two loads joined in a register, with no conversion; the sign bits go onto
 * the floats' sign bits, and a unit's scale multiplies its sum once. Their sums go into the
 * chains' v8f partner, c->m, negated (acc_sum subtracts it). */
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef float uv4f __attribute__((vector_size(16), aligned(1), may_alias));

static float grid_iq3_xxs[256 * 4], grid_iq3_s[512 * 4];
/* IQ3_S's as bytes, a row's 4 values a word (its integer kernel gathers them without VBMI);
 * and each grid's values (at most 8) and its rows as codes, 3 bits a value (its place among
 * those), two values a byte: [0][r] values 0 and 1 of row r, [1][r] values 2 and 3 (the integer
 * kernels with AVX-512 VBMI look the codes up in registers) */
static uint32_t grid8_iq3_s[512];
static uint8_t codes_iq3_xxs[2][256], codes_iq3_s[2][512];
static uint8_t levels_iq3_xxs[16], levels_iq3_s[16];
static atomic_int grids_set;

INLINE int byte_valued(float v) { return v >= 0.0f && v <= 255.0f && v == (float)(int)v; }

/* A grid's rows as codes (3 bits a value: its place among the grid's values, in levels), two
 * a byte (codes[k / 2][r], value k at bit 3 (k % 2)): 0 if it has more than 8 values */
static int grid_codes(const float *grid, int rows, uint8_t *codes, uint8_t *levels) {
    int n = 0;
    memset(levels, 0, 16);
    for (int r = 0; r < rows; r++) {
        codes[r] = codes[rows + r] = 0;
        for (int k = 0; k < 4; k++) {
            const uint8_t v = (uint8_t)grid[4 * r + k];
            int at = 0;
            while (at < n && levels[at] != v) at++;
            if (at == n) {
                if (n == 8) return 0;
                levels[n++] = v;
            }
            codes[(k / 2) * rows + r] |= (uint8_t)(at << (3 * (k % 2)));
        }
    }
    return 1;
}

/* Copy the float32 grids of IQ3_XXS (256 rows of 4) and IQ3_S (512 rows): 1 if their sizes
 * are these and their values bytes, 8 or fewer a grid; else 0, and the grids stay as they were
 * (the grid types unsupported until a call succeeds). */
int strata_set_grids(const float *iq3_xxs, int xxs_rows, const float *iq3_s, int s_rows) {
    if (xxs_rows != 256 || s_rows != 512) return 0;
    for (int i = 0; i < 4 * 512; i++) /* the grids' values are integers 0..255, 8 or fewer */
        if (!byte_valued(iq3_s[i]) || (i < 4 * 256 && !byte_valued(iq3_xxs[i]))) return 0;
    uint8_t cx[2 * 256], cs[2 * 512], lx[16], ls[16];
    if (!grid_codes(iq3_xxs, 256, cx, lx) || !grid_codes(iq3_s, 512, cs, ls)) return 0;
    memcpy(codes_iq3_xxs, cx, sizeof cx);
    memcpy(codes_iq3_s, cs, sizeof cs);
    memcpy(levels_iq3_xxs, lx, sizeof lx);
    memcpy(levels_iq3_s, ls, sizeof ls);
    memcpy(grid_iq3_xxs, iq3_xxs, sizeof grid_iq3_xxs);
    memcpy(grid_iq3_s, iq3_s, sizeof grid_iq3_s);
    for (int r = 0; r < 512; r++) {
        uint32_t word = 0;
        for (int k = 0; k < 4; k++) word |= (uint32_t)iq3_s[4 * r + k] << (8 * k);
        grid8_iq3_s[r] = word;
    }
    atomic_store(&grids_set, 1);
    return 1;
}

/* two vectors of 4 as one of 8 (vinsertf128 on x86); compilers without the builtin get the
 * same through memory */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define JOIN4(a, b) __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7)
#else
INLINE v8f JOIN4(v4f a, v4f b) {
    v8f g;
    memcpy(&g, &a, sizeof a);
    memcpy((char *)&g + sizeof a, &b, sizeof b);
    return g;
}
#endif

INLINE v8f grid8(const float *r0, const float *r1, uint32_t signs) {
    const v4f a = *(const uv4f *)r0, b = *(const uv4f *)r1;
    const v8f g = JOIN4(a, b);
    const v8u neg = ((v8u){0} + signs) << (v8u){31, 30, 29, 28, 27, 26, 25, 24} & 0x80000000u;
    return (v8f)((v8u)g ^ neg);
}

/* IQ3_XXS (256; qs 64 grid indices, ss 32 = a u32 per 32 elements, d 2, grid 256 x 4 bytes,
 * ks 128 sign patterns): unit j's word: scale s in bits 28..31, the sign pattern of its i-th 8
 * elements at bits 7i; value = (d (0.5 + s) 0.5) * grid, negated where the pattern says. */
INLINE void blk_iq3_xxs(const uint8_t *const *p, int b, const float *x, const float *xs,
                        acc_t *c) {
    (void)xs;
    const uint8_t *qs = p[0] + 64 * b, *ss = p[1] + 32 * b, *ks = p[4];
    const float d = ld_f16(p[2] + 2 * b);
    x += 256 * b;
    v8f t = {0};
    for (int j = 0; j < 8; j++) {
        const uint32_t word = ld_u32(ss + 4 * j);
        const uint8_t *q = qs + 8 * j;
        v8f u = {0};
        for (int i = 0; i < 4; i++) {
            const uint32_t sg = ks[(word >> (7 * i)) & 127];
            u += grid8(grid_iq3_xxs + 4 * q[2 * i], grid_iq3_xxs + 4 * q[2 * i + 1], sg) *
                 ldf8(x + 32 * j + 8 * i);
        }
        t += (d * (0.5f + (float)(word >> 28)) * 0.5f) * u;
    }
    c->m -= t;
}

/* IQ3_S (256; qs 64 low bits of grid indices, hs 44 = qh 8 | signs 32 | scales 4, d 2, grid
 * 512 x 4 bytes): index i's ninth bit is bit i % 8 of qh[i / 8]; element e is negative where
 * bit e % 8 of signs[e / 8] is set; unit j's scale s is nibble j % 2 of scales[j / 2];
 * value = (d (1 + 2 s)) * grid. */
INLINE void blk_iq3_s(const uint8_t *const *p, int b, const float *x, const float *xs,
                      acc_t *c) {
    (void)xs;
    const uint8_t *qs = p[0] + 64 * b, *hs = p[1] + 44 * b;
    const float d = ld_f16(p[2] + 2 * b);
    x += 256 * b;
    v8f t = {0};
    for (int j = 0; j < 8; j++) {
        const uint8_t *q = qs + 8 * j;
        const uint32_t high = hs[j];
        v8f u = {0};
        for (int i = 0; i < 4; i++) {
            const int i0 = q[2 * i] | ((high >> (2 * i)) & 1) << 8;
            const int i1 = q[2 * i + 1] | ((high >> (2 * i + 1)) & 1) << 8;
            u += grid8(grid_iq3_s + 4 * i0, grid_iq3_s + 4 * i1, hs[8 + 4 * j + i]) *
                 ldf8(x + 32 * j + 8 * i);
        }
        t += (d * (float)(1 + 2 * ((hs[40 + j / 2] >> (4 * (j % 2))) & 15))) * u;
    }
    c->m -= t;
}

#if I8
/* The grid types' integer kernels: a unit's 8 grid rows as 32 bytes (its values in order), the
 * signs put on x's bytes (a bit an element), a unit's scale times its dx. 16 lanes: units 2 w
 * and 2 w + 1 a step, lanes 0-7 the first's (g: their values; sg: their sign bits). The rows'
 * values: with AVX-512 VBMI from their codes, looked up in registers (row_codes, code_values);
 * else IQ3_S's gathered (idx: the 8 or 16 rows), and IQ3_XXS keeps its float kernel. Per thread
 * on a Zen 4 core: IQ3_S 2.3 GB/s in float, 3.3 gathered, 4.5 from codes; IQ3_XXS 2.7 in
 * float, 2.2-2.9 gathered or loaded row by row, 4.2-4.8 from codes (the gather alone took 60%
 * of IQ3_S's time). */
#if I8 == 16
/* g: two units' values, 32 bytes each */
INLINE void grid_units_f(__m512i g, uint64_t sg, const int8_t *xq, vf f, acc_t *c, int chain) {
    const __m512i x = _mm512_loadu_si512(xq);
    const __m512i sx = _mm512_mask_sub_epi8(x, (__mmask64)sg, _mm512_setzero_si512(), x);
    c->a[chain] += __builtin_convertvector(dot4(g, sx), vf) * f;
}

INLINE void grid_units(__m512i g, uint64_t sg, const int8_t *xq, float s0, float s1, acc_t *c,
                       int chain) {
    const vf f = (vf)_mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s0), _mm512_set1_ps(s1));
    grid_units_f(g, sg, xq, f, c, chain);
}

/* a block's 8 unit scales times their dx (dx: the block's 16, twice a unit), and those of step
 * w's two units as lanes 0-7 and 8-15 */
INLINE v8f unit_scales(v8f s, const float *dx) {
    const vi even = {0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0};
    return s * (v8f)_mm512_castps512_ps256(_mm512_permutexvar_ps((__m512i)even, ldf(dx)));
}

INLINE vf step_scales(v8f s, int w) {
    const vi at = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
    return (vf)_mm512_permutexvar_ps((__m512i)(at + 2 * w), _mm512_castps256_ps512((__m256)s));
}
#else
INLINE void grid_units(const uint32_t *grid, __m256i idx, uint32_t sg, const int8_t *xq,
                       float s0, acc_t *c, int chain) {
    const __m256i g = _mm256_i32gather_epi32((const int *)grid, idx, 4);
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                                          2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
    const __m256i by = _mm256_shuffle_epi8(_mm256_set1_epi32((int)sg), pick);
    const __m256i m = _mm256_cmpeq_epi8(_mm256_and_si256(by, bit), bit); /* -1 where negative */
    const __m256i x = _mm256_loadu_si256((const __m256i *)xq);
    const __m256i sx = _mm256_sub_epi8(_mm256_xor_si256(x, m), m);
    c->a[chain] += __builtin_convertvector(dot4(g, sx), v8f) * s0;
}
#endif

#if GRID_CODES
/* A code byte of each of 64 grid rows (idx: the rows' low 8 bits, ninth: their bit 8 where
 * the grid has 512): a two-register byte lookup for each 128 rows, picked by bits 7 and 8 */
INLINE __m512i row_codes(const uint8_t *t, int rows, __m512i idx, __mmask64 ninth) {
    const __mmask64 b7 = _mm512_test_epi8_mask(idx, _mm512_set1_epi8((char)0x80));
    __m512i r[4];
    for (int i = 0; i < rows / 128; i++)
        r[i] = _mm512_permutex2var_epi8(_mm512_loadu_si512(t + 128 * i), idx,
                                        _mm512_loadu_si512(t + 128 * i + 64));
    __m512i out = _mm512_mask_mov_epi8(r[0], b7, r[1]);
    if (rows == 512) out = _mm512_mask_mov_epi8(out, ninth, _mm512_mask_mov_epi8(r[2], b7, r[3]));
    return out;
}

/* the values of rows 16 w .. 16 w + 15 as 64 bytes, from their code bytes (c01: values 0 and 1
 * of 64 rows, c23: 2 and 3): each row's word as its bytes [c01, c01, c23, c23], each byte's
 * value (bits 0-2, or 3-5 in the odd bytes) looked up among the levels */
INLINE __m512i code_values(__m512i c01, __m512i c23, int w, const uint8_t *levels) {
    const __m512i lane = _mm512_set_epi8(
        79, 79, 15, 15, 78, 78, 14, 14, 77, 77, 13, 13, 76, 76, 12, 12, 75, 75, 11, 11, 74, 74,
        10, 10, 73, 73, 9, 9, 72, 72, 8, 8, 71, 71, 7, 7, 70, 70, 6, 6, 69, 69, 5, 5, 68, 68, 4,
        4, 67, 67, 3, 3, 66, 66, 2, 2, 65, 65, 1, 1, 64, 64, 0, 0);
    const __m512i at = _mm512_add_epi8(lane, _mm512_set1_epi8((char)(16 * w)));
    const __m512i word = _mm512_permutex2var_epi8(c01, at, c23), seven = _mm512_set1_epi8(7);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi16(word, 3), seven);
    const __m512i code =
        _mm512_mask_blend_epi8(0xAAAAAAAAAAAAAAAAull, _mm512_and_si512(word, seven), odd);
    const __m512i lv = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)levels));
    return _mm512_shuffle_epi8(lv, code);
}
#endif

/* IQ3_S: unit j's 8 indices at qs[8 j..] with their ninth bits in hs[j], its 32 sign bits at
 * hs[8 + 4 j..], its scale d (1 + 2 s), s nibble j % 2 of hs[40 + j / 2] */
INLINE void blk_iq3_s8(const uint8_t *const *p, int b, const xq_t *in, acc_t *c) {
    const uint8_t *qs = p[0] + 64 * b, *hs = p[1] + 44 * b;
    const float d = ld_f16(p[2] + 2 * b);
    const float *dx = in->d + 16 * b;
    const int8_t *xq = in->q + 256 * b;
#if GRID_CODES
    const uint8_t *h4 = hs + 40;
    const v8u nib = (v8u){h4[0], h4[0], h4[1], h4[1], h4[2], h4[2], h4[3], h4[3]} >>
                    (v8u){0, 4, 0, 4, 0, 4, 0, 4} & 15;
    const v8f sc = unit_scales(d * (1.0f + 2.0f * __builtin_convertvector(nib, v8f)), dx);
    const __m512i idx = _mm512_loadu_si512(qs);
    uint64_t ninth, sg[4];
    memcpy(&ninth, hs, 8);
    memcpy(sg, hs + 8, sizeof sg);
    const __m512i c01 = row_codes(codes_iq3_s[0], 512, idx, ninth);
    const __m512i c23 = row_codes(codes_iq3_s[1], 512, idx, ninth);
#pragma GCC unroll 4
    for (int w = 0; w < 4; w++) {
        const __m512i g = code_values(c01, c23, w, levels_iq3_s);
        grid_units_f(g, sg[w], xq + 64 * w, step_scales(sc, w), c, w);
    }
#else
    float sc[8];
    for (int j = 0; j < 8; j++)
        sc[j] = d * (float)(1 + 2 * ((hs[40 + j / 2] >> (4 * (j % 2))) & 15)) * dx[2 * j];
#if I8 == 16
#pragma GCC unroll 4
    for (int w = 0; w < 4; w++) {
        __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16 * w)));
        const __mmask16 high = (__mmask16)(hs[2 * w] | hs[2 * w + 1] << 8);
        idx = _mm512_mask_or_epi32(idx, high, idx, _mm512_set1_epi32(256));
        uint64_t sg;
        memcpy(&sg, hs + 8 + 8 * w, 8);
        const __m512i g = _mm512_i32gather_epi32(idx, (const void *)grid8_iq3_s, 4);
        grid_units(g, sg, xq + 64 * w, sc[2 * w], sc[2 * w + 1], c, w);
    }
#else
    const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * j)));
        const __m256i high = _mm256_and_si256(_mm256_set1_epi32(hs[j]), bits);
        idx = _mm256_or_si256(idx, _mm256_and_si256(_mm256_cmpeq_epi32(high, bits),
                                                     _mm256_set1_epi32(256)));
        grid_units(grid8_iq3_s, idx, ld_u32(hs + 8 + 4 * j), xq + 32 * j, sc[j], c, j & 3);
    }
#endif
#endif
}

#if GRID_CODES
/* IQ3_XXS's sign bits of a block's 8 units, 32 a unit, from each unit's word's four 7-bit
 * patterns: a pattern's eighth bit makes its count of set bits even (the ks table's rule,
 * computed for the 8 at once, not looked up 32 times) */
INLINE v8u xxs_signs(v8u word) {
    const v8u s = (word & 0x7f) | (word & 0x3f80) << 1 | (word & 0x1fc000) << 2 |
                  (word & 0xfe00000) << 3;
    v8u par = s ^ s >> 4;
    par ^= par >> 2;
    par ^= par >> 1;
    return s | (par & 0x01010101u) << 7;
}

/* IQ3_XXS: unit j's 8 indices at qs[8 j..], its word (scale and sign patterns) at ss[4 j]; the
 * values from the codes (the gathers, with or without AVX-512, and AVX2's sign lookups were no
 * faster than the float kernel) */
INLINE void blk_iq3_xxs8(const uint8_t *const *p, int b, const xq_t *in, acc_t *c) {
    const uint8_t *qs = p[0] + 64 * b, *ss = p[1] + 32 * b;
    const float d = ld_f16(p[2] + 2 * b);
    const float *dx = in->d + 16 * b;
    const int8_t *xq = in->q + 256 * b;
    v8u words;
    memcpy(&words, ss, sizeof words);
    const v8u signs = xxs_signs(words);
    uint64_t sg[4];
    memcpy(sg, &signs, sizeof sg);
    const v8f sc = unit_scales((0.5f * d) * (0.5f + __builtin_convertvector(words >> 28, v8f)),
                               dx);
    const __m512i idx = _mm512_loadu_si512(qs);
    const __m512i c01 = row_codes(codes_iq3_xxs[0], 256, idx, 0);
    const __m512i c23 = row_codes(codes_iq3_xxs[1], 256, idx, 0);
#pragma GCC unroll 4
    for (int w = 0; w < 4; w++) {
        const __m512i g = code_values(c01, c23, w, levels_iq3_xxs);
        grid_units_f(g, sg[w], xq + 64 * w, step_scales(sc, w), c, w);
    }
}
#endif
#endif /* I8 */

INLINE float el_f32(const uint8_t *w, int i) { return u2f(ld_u32(w + 4 * i)); }
INLINE float el_f16(const uint8_t *w, int i) { return ld_f16(w + 2 * i); }
INLINE float el_bf16(const uint8_t *w, int i) {
    return u2f((uint32_t)(w[2 * i] | w[2 * i + 1] << 8) << 16);
}

/* The elements after a row's last whole block: only the floats' rows have any. */
#define FLOAT_TAIL(T)                                                                         \
    INLINE float tail_##T(const uint8_t *const *p, int from, int cols, const float *x,        \
                          const xq_t *q) {                                                    \
        (void)q;                                                                              \
        float s = 0.0f;                                                                       \
        for (int i = from; i < cols; i++) s += el_##T(p[0], i) * x[i];                        \
        return s;                                                                             \
    }
#define NO_TAIL(T)                                                                            \
    INLINE float tail_##T(const uint8_t *const *p, int from, int cols, const float *x,        \
                          const xq_t *q) {                                                    \
        (void)p, (void)from, (void)cols, (void)x, (void)q;                                    \
        return 0.0f;                                                                          \
    }
FLOAT_TAIL(f32)
FLOAT_TAIL(f16)
FLOAT_TAIL(bf16)
NO_TAIL(q4_k)
NO_TAIL(q5_k)
NO_TAIL(q6_k)
NO_TAIL(iq4_xs)
NO_TAIL(q8_0)
NO_TAIL(q4_0)
NO_TAIL(q4_1)
NO_TAIL(q5_0)
NO_TAIL(q5_1)
NO_TAIL(iq4_nl)
NO_TAIL(mxfp4)
NO_TAIL(q2_k)
NO_TAIL(q2_k8)
NO_TAIL(q3_k8)
NO_TAIL(q4_k8)
NO_TAIL(q6_k8)
NO_TAIL(iq3_s8)
#if GRID_CODES
NO_TAIL(iq3_xxs8)
#endif
NO_TAIL(q5_k8)
NO_TAIL(iq4_xs8)
/* The types taken two blocks a step (IQ4_NL, MXFP4, the one-scale types): a row of an odd number
 * of blocks ends in one, taken by the type's float kernel over the int8 input's values (as the
 * pairs read them), its N planes from that block on (B: each plane's bytes a block; 0: a fixed
 * plane, as it is) */
#define LONE_TAIL(T, N, B0, B1, B2, B3)                                                      \
    INLINE float tail_##T##8(const uint8_t *const *p, int from, int cols, const float *x,     \
                             const xq_t *q) {                                                 \
        (void)x;                                                                              \
        if (from >= cols) return 0.0f;                                                        \
        float v[32], sum = 0.0f;                                                              \
        for (int i = 0; i < 32; i++) sum += v[i] = q->d[(from + i) / 16] * q->q[from + i];   \
        const int b = from / 32, bytes[4] = {B0, B1, B2, B3};                                 \
        const uint8_t *at[4];                                                                 \
        for (int i = 0; i < 4; i++) at[i] = i < (N) ? p[i] + bytes[i] * b : p[0];             \
        acc_t c = {0};                                                                        \
        blk_##T(at, 0, v, &sum, &c);                                                          \
        return acc_sum(&c);                                                                   \
    }
LONE_TAIL(iq4_nl, 3, 16, 2, 0, 0)
LONE_TAIL(mxfp4, 3, 16, 1, 0, 0)
LONE_TAIL(q8_0, 2, 32, 2, 0, 0)
LONE_TAIL(q4_0, 2, 16, 2, 0, 0)
LONE_TAIL(q4_1, 3, 16, 2, 2, 0)
LONE_TAIL(q5_0, 3, 16, 4, 2, 0)
LONE_TAIL(q5_1, 4, 16, 4, 2, 2)
NO_TAIL(q3_k)
NO_TAIL(iq3_xxs)
NO_TAIL(iq3_s)

/* Per type, from its block function:
 * dot1: one row's dot product with x (down's rows, and gate's and up's of two types);
 * dot2: two rows of one type with the same x in one pass (an expert's gate and up rows). */
typedef const uint8_t *planes_t[STRATA_MAX_PLANES];
typedef float (*dot1_fn)(const uint8_t *const *p, int cols, const float *x, const float *xs,
                         const xq_t *q);
typedef void (*dot2_fn)(const uint8_t *const *pa, const uint8_t *const *pb, int cols,
                        const float *x, const float *xs, const xq_t *q, float *out);

/* the quantised input of expert e's part (cols elements a part) */
INLINE xq_t xq_at(const xq_t *q, int e, int cols) {
    if (!q->q) return (xq_t){0}; /* no kernel of the job reads it */
    const int64_t at = (int64_t)e * cols;
    return (xq_t){q->q + at, q->d + at / 16, q->s + at / 16, q->n ? q->n + at / 4 : NULL};
}

/* The two from a block function of the float input (x and its unit sums; q unread), or with
 * I8 from one of the quantised input (x unread but by a pair type's last block). */
#define DOTS_(T, BLOCK, ARGS)                                                                 \
    static float dot1_##T(const uint8_t *const *p, int cols, const float *x, const float *xs, \
                          const xq_t *q) {                                                    \
        (void)x, (void)xs, (void)q;                                                           \
        acc_t c = {0};                                                                        \
        const int nb = cols / (BLOCK);                                                        \
        for (int b = 0; b < nb; b++) blk_##T(p, b, ARGS, &c);                                 \
        return acc_sum(&c) + tail_##T(p, nb * (BLOCK), cols, x, q);                           \
    }                                                                                         \
    static void dot2_##T(const uint8_t *const *pa, const uint8_t *const *pb, int cols,        \
                         const float *x, const float *xs, const xq_t *q, float *out) {        \
        (void)x, (void)xs, (void)q;                                                           \
        acc_t a = {0}, c = {0};                                                               \
        const int nb = cols / (BLOCK);                                                        \
        for (int b = 0; b < nb; b++) {                                                        \
            blk_##T(pa, b, ARGS, &a);                                                         \
            blk_##T(pb, b, ARGS, &c);                                                         \
        }                                                                                     \
        out[0] = acc_sum(&a) + tail_##T(pa, nb * (BLOCK), cols, x, q);                        \
        out[1] = acc_sum(&c) + tail_##T(pb, nb * (BLOCK), cols, x, q);                        \
    }

#define DOTS(T, BLOCK) DOTS_(T, BLOCK, PASS(x, xs))
#define DOTS_I8(T, BLOCK) DOTS_(T, BLOCK, q)
#define PASS(a, b) a, b
/* a type with an integer kernel: that one where the machine has it (its blocks taken BLOCK8
 * elements at a time), else the float one; EITHER names the chosen three in TYPES */
#if I8
#define DOTS_EITHER(T, BLOCK, BLOCK8) DOTS_I8(T##8, BLOCK8)
#define EITHER(T) FNS(T##8), 1
#else
#define DOTS_EITHER(T, BLOCK, BLOCK8) DOTS(T, BLOCK)
#define EITHER(T) FNS(T), 0
#endif
DOTS_EITHER(q4_k, 256, 256)
DOTS_EITHER(q5_k, 256, 256)
DOTS_EITHER(q6_k, 256, 256)
DOTS_EITHER(iq4_xs, 256, 256)
DOTS_EITHER(q8_0, 32, 64)
DOTS_EITHER(q4_0, 32, 64)
DOTS_EITHER(q4_1, 32, 64)
DOTS_EITHER(q5_0, 32, 64)
DOTS_EITHER(q5_1, 32, 64)
DOTS_EITHER(iq4_nl, 32, 64)
DOTS_EITHER(mxfp4, 32, 64)
DOTS_EITHER(q2_k, 256, 256)
DOTS_EITHER(q3_k, 256, 256)
#if GRID_CODES
DOTS_EITHER(iq3_xxs, 256, 256)
#else
DOTS(iq3_xxs, 256)
#endif
DOTS_EITHER(iq3_s, 256, 256)
DOTS(f32, H)
DOTS(f16, H)
DOTS(bf16, H)

/* Per type: elements per block and each plane's bytes per block (0: a fixed plane, once per
 * matrix), in repack.PLANES order (repack.KERNEL_PLANE_BYTES; the floats' one plane is w). */
typedef struct {
    int32_t qtype;
    int32_t block;
    int32_t nplanes;
    int32_t bytes[STRATA_MAX_PLANES];
    dot1_fn dot1;
    dot2_fn dot2;
    int32_t i8; /* 1: its kernels read the input quantised (xq_t), not x */
} qtype_info;

#define FNS(T) dot1_##T, dot2_##T
static const qtype_info TYPES[] = {
    {T_Q4_K, 256, 5, {128, 8, 8, 2, 2}, EITHER(q4_k)},
    {T_Q5_K, 256, 5, {128, 32, 8, 8, 4}, EITHER(q5_k)},
    {T_Q6_K, 256, 4, {128, 64, 16, 2}, EITHER(q6_k)},
    {T_IQ4_XS, 256, 4, {128, 8, 2, 0}, EITHER(iq4_xs)},
    {T_Q8_0, 32, 2, {32, 2}, EITHER(q8_0)},
    {T_Q4_0, 32, 2, {16, 2}, EITHER(q4_0)},
    {T_Q4_1, 32, 3, {16, 2, 2}, EITHER(q4_1)},
    {T_Q5_0, 32, 3, {16, 4, 2}, EITHER(q5_0)},
    {T_Q5_1, 32, 4, {16, 4, 2, 2}, EITHER(q5_1)},
    {T_IQ4_NL, 32, 3, {16, 2, 0}, EITHER(iq4_nl)},
    {T_MXFP4, 32, 3, {16, 1, 0}, EITHER(mxfp4)},
    {T_Q2_K, 256, 4, {64, 16, 2, 2}, EITHER(q2_k)},
    {T_Q3_K, 256, 4, {64, 32, 12, 2}, EITHER(q3_k)},
#if GRID_CODES
    {T_IQ3_XXS, 256, 5, {64, 32, 2, 0, 0}, EITHER(iq3_xxs)},
#else
    {T_IQ3_XXS, 256, 5, {64, 32, 2, 0, 0}, FNS(iq3_xxs), 0},
#endif
    {T_IQ3_S, 256, 4, {64, 44, 2, 0}, EITHER(iq3_s)},
    {T_F32, 1, 1, {4}, FNS(f32)},
    {T_F16, 1, 1, {2}, FNS(f16)},
    {T_BF16, 1, 1, {2}, FNS(bf16)},
};

static const qtype_info *type_info(int32_t qtype) {
    for (size_t i = 0; i < sizeof TYPES / sizeof TYPES[0]; i++)
        if (TYPES[i].qtype == qtype) return &TYPES[i];
    return NULL;
}

/* The block size and plane bytes the library reads qtype with: out[0] elements per block,
 * out[1] planes, out[2..] each plane's bytes per block (0: a fixed plane). 0 if unsupported. */
int strata_type_layout(int32_t qtype, int32_t *out) {
    const qtype_info *ti = type_info(qtype);
    if (!ti) return 0;
    out[0] = ti->block;
    out[1] = ti->nplanes;
    for (int i = 0; i < STRATA_MAX_PLANES; i++) out[2 + i] = i < ti->nplanes ? ti->bytes[i] : 0;
    return 1;
}

/* 1 if the library computes matrices of GGML type qtype. */
int strata_supported(int32_t qtype) {
    if ((qtype == T_IQ3_XXS || qtype == T_IQ3_S) && !atomic_load(&grids_set)) return 0;
    return type_info(qtype) != NULL;
}

/* 1 if the library's kernels of qtype read their input quantised to int8 (xq_t): their results
 * then differ from the float kernels' by that rounding of the input. */
int strata_int8_input(int32_t qtype) {
    const qtype_info *ti = type_info(qtype);
    return ti && ti->i8;
}

/* sizeof(strata_job): the Python wrapper checks its ctypes mirror against it. */
size_t strata_job_bytes(void) { return sizeof(strata_job); }

/* The plane pointers of row r of matrix m in the slot at `slot`. */
static void row_planes(const strata_mat *m, const qtype_info *ti, const uint8_t *slot, int r,
                       const uint8_t **p) {
    const uint8_t *mat = slot + m->offset;
    const int64_t nb = m->cols / ti->block;
    for (int i = 0; i < ti->nplanes; i++)
        p[i] = mat + m->planes[i] + (int64_t)r * nb * ti->bytes[i];
}

/* out[j] = x[32 j] + ... + x[32 j + 31] for j in [lo, hi). */
static void unit_sums(const float *x, int64_t lo, int64_t hi, float *out) {
    for (int64_t j = lo; j < hi; j++) {
        vf s = ldf(x + 32 * j);
        for (int i = H; i < 32; i += H) s += ldf(x + 32 * j + i);
        out[j] = hsum(s);
    }
}

/* Units [lo, hi) of x (32 values each) quantised as xq_t describes, into q, d and s (indexed as
 * x is: unit j at q + 32 j, d + 2 j, s + 2 j) and, with LEVEL_SUMS, n (x is made of parts of
 * `per` units each, a row's input: each part's 64-value steps start at its first unit; a part's
 * last unit of an odd count, which the kernels take in float, gets none). A unit holding a NaN or
 * an infinity gets the scale NaN (and zeros), so the products it enters are NaN, as the float
 * kernels' would be. */
static void quantize_units(const float *x, int64_t lo, int64_t hi, int64_t per, int8_t *q,
                           float *d, float *s, int32_t *n) {
    /* a unit in vectors: |x|'s largest, whether all are finite (a NaN compares false), then
     * x / dx rounded half to even (adding and taking away 1.5 2^23: exact below 2^22, as
     * nearbyintf in the default rounding), the group sums in lanes */
    const vf round = (vf){0} + 12582912.0f;
    for (int64_t j = lo; j < hi; j++) {
        const float *xj = x + 32 * j;
        vf top = {0};
        vi finite = (vi){0} - 1;
        for (int i = 0; i < 32; i += H) {
            const vf a = (vf)((vu)ldf(xj + i) & 0x7fffffffu);
            const vi more = (vi)(a > top);
            top = (vf)(((vi)a & more) | ((vi)top & ~more));
            finite &= (vi)(a <= 3.4028235e38f);
        }
        float amax = 0.0f;
        int ok = 1;
        for (int k = 0; k < H; k++) {
            amax = top[k] > amax ? top[k] : amax;
            ok &= finite[k] != 0;
        }
        const float dx = ok ? amax / 127.0f : NAN;
        /* n: values 16 h + 4 l .. + 3 of unit u go to lane l of chunk (u odd) + 2 h of its
         * step, at out[8 h + l] */
        const int64_t u = j % per;
        int32_t *out = n && !(u == per - 1 && per % 2)
                           ? n + 8 * (j - u) + 16 * (u / 2) + 4 * (u % 2) : NULL;
        vi sum[2] = {{0}, {0}};
        if (ok && amax > 0.0f) {
            for (int i = 0; i < 32; i += H) {
                const vi v = __builtin_convertvector((ldf(xj + i) / dx + round) - round, vi);
                const vc b = __builtin_convertvector(v, vc);
                memcpy(q + 32 * j + i, &b, H);
                sum[i / 16] += v;
                if (out) { /* sums of 4 lanes: lane 4 k holds lanes 4 k .. 4 k + 3's */
                    const vi s2 = v + __builtin_shuffle(v, lane_ids_i() ^ 1);
                    const vi s4 = s2 + __builtin_shuffle(s2, lane_ids_i() ^ 2);
                    for (int k = 0; k < H / 4; k++)
                        out[8 * (i / 16) + (i % 16) / 4 + k] = -128 * s4[4 * k];
                }
            }
        } else {
            memset(q + 32 * j, 0, 32);
            if (out)
                for (int h = 0; h < 2; h++) memset(out + 8 * h, 0, 4 * sizeof *out);
        }
        for (int g = 0; g < 2; g++) {
            int total = 0;
            for (int k = 0; k < H; k++) total += sum[g][k];
            d[2 * j + g] = dx;
            s[2 * j + g] = dx * (float)total;
        }
    }
}

/* x's n values quantised as a job quantises its input, into q [n], d and s [n / 16] (xq_t): for
 * the tests. 0 (and nothing written) unless n is whole units of 32. */
int strata_quantize(const float *x, int n, int8_t *q, float *d, float *s) {
    if (n <= 0 || n % 32) return 0;
    quantize_units(x, 0, n / 32, n / 32, q, d, s, NULL);
    return 1;
}

/* Row `row` of matrix m (in the slot at `slot`) times x, as a job's kernels compute it, the input
 * prepared as a job prepares h (its unit sums; quantised for an I8 type): for the tests and the
 * bench. NaN where the type is not computed here, cols is not whole blocks and units, or the
 * scratch cannot be had. */
float strata_dot(const strata_mat *m, const uint8_t *slot, int row, const float *x) {
    const qtype_info *ti = type_info(m->qtype);
    if (!ti || m->cols % ti->block || (ti->i8 && m->cols % 32) || row < 0 || row >= m->rows)
        return NAN;
    const int64_t units = m->cols / 32;
    float *f = malloc((size_t)(5 * units) * sizeof(float));
    int8_t *q = malloc((size_t)m->cols);
    int32_t *n = LEVEL_SUMS ? malloc((size_t)m->cols) : NULL; /* (8 a unit: cols / 4) */
    float out = NAN;
    if (f && q && (n || !LEVEL_SUMS)) {
        unit_sums(x, 0, units, f);
        quantize_units(x, 0, units, units, q, f + units, f + 3 * units, n);
        const xq_t in = {q, f + units, f + 3 * units, n};
        planes_t p;
        row_planes(m, ti, slot, row, p);
        out = ti->dot1(p, m->cols, x, f, &in);
    }
    free(f);
    free(q);
    free(n);
    return out;
}

/* -- the pool ------------------------------------------------------------------------------ */

#ifndef STRATA_SPIN_NS
/* How long an idle worker spins before it sleeps. A decode step's layers hand out a job every
 * 0.1-0.5 ms: the workers keep spinning from one to the next (on the H200's host a wake-up from
 * sleep cost ~100 us a job: 253 against 156 us for two experts on 15 threads), and sleep 3 ms
 * after the last one. */
#define STRATA_SPIN_NS 3000000
#endif

struct strata_pool {
    int nthreads; /* the workers and the caller */
    int started;  /* workers running */
    pthread_t *tids;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* the job now running, written by its caller before `gen` moves on */
    const strata_job *job;
    int n;
    float *hsums; /* [D / 32] unit sums of h, by the caller */
    float *asums; /* [n * F / 32] unit sums of act, in phase 1 */
    xq_t hq, aq;  /* h and act quantised, where a kernel of the job reads them (an I8 type) */
    float *sums;  /* the storage of the sums and the quantised inputs' scales and group sums */
    size_t sums_cap;
    int8_t *bytes; /* the storage of the quantised inputs' values */
    size_t bytes_cap;
    int64_t t1; /* when the running job's phase 1 ended everywhere (its caller's clock read) */
    /* each counter on its own cache line: the threads hammer them */
    _Alignas(64) atomic_uint_fast64_t gen; /* bumped once per job; workers run on a change */
    _Alignas(64) atomic_int sleepers;      /* workers waiting on cv */
    atomic_int stop;                       /* the workers: end (after the server has ended) */
    _Alignas(64) atomic_int arrived1; /* threads done with phase 1 (the barrier) */
    _Alignas(64) atomic_int arrived2; /* threads done with phase 2 */
    /* what the pool's jobs took (strata_pool_stats): written by the job's caller, one at a time */
    _Alignas(64) atomic_int_fast64_t jobs, busy_ns, phase1_ns;
    /* serving a device (strata_pool_serve) */
    int serving;
    pthread_t server_tid;
    pthread_cond_t scv; /* the server sleeps on it */
    void *mb;           /* strata_mailbox * */
    const strata_job **served;
    int n_served;
    _Alignas(64) atomic_int_fast64_t armed_until; /* now_ns() clock */
    atomic_int server_sleeping;
    atomic_int halt; /* the server: end */
};

INLINE float silu(float g) { return g / (1.0f + expf(-g)); }

/* gpt-oss's clamped SwiGLU (ops.SwigluOAI) */
INLINE float swiglu_oai(float g, float u, float alpha, float limit) {
    g = g < limit ? g : limit;
    u = u < -limit ? -limit : u > limit ? limit : u;
    return g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
}

static const uint8_t *slot_of(const strata_job *job, int i) {
    return (const uint8_t *)(uintptr_t)(job->base + job->offs[i]);
}

/* Phase 1: act[i] for rows [lo, hi) of the n * F gate/up rows (i = e * F + r), then the unit
 * sums of act that fall wholly in [lo, hi) (lo is a multiple of 32; the sums are read only when
 * F is one too, so no unit spans two experts). */
static void phase1(const strata_pool *pool, const strata_job *job, int lo, int hi) {
    const qtype_info *tg = type_info(job->gate.qtype), *tu = type_info(job->up.qtype);
    const int F = job->F, D = job->D;
    planes_t pg, pu;
    for (int i = lo; i < hi; i++) {
        const int e = i / F, r = i % F;
        const uint8_t *slot = slot_of(job, e);
        row_planes(&job->gate, tg, slot, r, pg);
        row_planes(&job->up, tu, slot, r, pu);
        float gu[2];
        if (tg == tu) {
            tg->dot2(pg, pu, D, job->h, pool->hsums, &pool->hq, gu);
        } else {
            gu[0] = tg->dot1(pg, D, job->h, pool->hsums, &pool->hq);
            gu[1] = tu->dot1(pu, D, job->h, pool->hsums, &pool->hq);
        }
        if (job->bias_gate) {
            const int64_t at = (int64_t)job->ids[e] * F + r;
            gu[0] += job->bias_gate[at];
            gu[1] += job->bias_up[at];
        }
        job->act[i] = job->oai ? swiglu_oai(gu[0], gu[1], job->alpha, job->limit)
                               : silu(gu[0]) * gu[1];
    }
    if (pool->aq.q) /* down reads act quantised, else (the float kernels) its unit sums */
        quantize_units(job->act, lo / 32, hi / 32, F / 32, (int8_t *)pool->aq.q,
                       (float *)pool->aq.d, (float *)pool->aq.s, (int32_t *)pool->aq.n);
    else
        unit_sums(job->act, lo / 32, hi / 32, pool->asums);
}

/* Phase 2: y[r] for rows [lo, hi) of down: expert by expert, each one's rows in order (its
 * planes read as a few sequential streams; row by row across the experts they were 5 a chosen
 * expert, more than the prefetchers follow), y[r] += wts[e] * (row r of expert e's down . act_e);
 * each row's sum in the experts' order, whichever thread takes it. */
static void phase2(const strata_pool *pool, const strata_job *job, int lo, int hi) {
    const qtype_info *td = type_info(job->down.qtype);
    const int F = job->F, n = pool->n;
    int64_t step[STRATA_MAX_PLANES]; /* a row's bytes in each plane (0: a fixed plane) */
    const int64_t nb = job->down.cols / td->block;
    for (int i = 0; i < td->nplanes; i++) step[i] = nb * td->bytes[i];
    for (int r = lo; r < hi; r++) job->y[r] = 0.0f;
    for (int e = 0; e < n; e++) {
        planes_t pd;
        row_planes(&job->down, td, slot_of(job, e), lo, pd);
        const xq_t aq = xq_at(&pool->aq, e, F);
        const float *act = job->act + (int64_t)e * F, *sums = pool->asums + e * (F / 32);
        const float w = job->wts[e];
        for (int r = lo; r < hi; r++) {
            job->y[r] += w * td->dot1(pd, F, act, sums, &aq);
            for (int i = 0; i < td->nplanes; i++) pd[i] += step[i];
        }
    }
    if (job->bias_down) /* each expert's down bias times its weight */
        for (int r = lo; r < hi; r++)
            for (int e = 0; e < n; e++)
                job->y[r] += job->wts[e] * job->bias_down[(int64_t)job->ids[e] * job->D + r];
}

INLINE void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

typedef struct {
    strata_pool *pool;
    int t;
} worker_arg;

/* Wait until `counter` reaches `want`: spin, then yield (with more threads than cores, the ones
 * waited for need the core). */
static void wait_count(atomic_int *counter, int want) {
    for (int i = 0; atomic_load_explicit(counter, memory_order_acquire) < want; i++) {
        if (i < 4096)
            cpu_relax();
        else
            sched_yield();
    }
}

/* Where thread t's rows of `total` start: phase 1's at multiples of 32 (whole units of act). */
static int split(int64_t total, int t, int T, int unit) {
    return t == T ? (int)total : (int)(total * t / T / unit * unit);
}

/* Thread t's share of the running job: its rows of phase 1, the barrier, its rows of phase 2. */
static void run_share(strata_pool *pool, int t) {
    const strata_job *job = pool->job;
    const int T = pool->nthreads;
    const int64_t r1 = (int64_t)pool->n * job->F;
    phase1(pool, job, split(r1, t, T, 32), split(r1, t + 1, T, 32));
    if (T > 1) {
        atomic_fetch_add_explicit(&pool->arrived1, 1, memory_order_acq_rel);
        wait_count(&pool->arrived1, T);
    }
    if (t == 0) pool->t1 = now_ns();
    phase2(pool, job, split(job->D, t, T, 1), split(job->D, t + 1, T, 1));
    if (T > 1) atomic_fetch_add_explicit(&pool->arrived2, 1, memory_order_release);
}

static void *worker(void *arg) {
    strata_pool *pool = ((worker_arg *)arg)->pool;
    const int t = ((worker_arg *)arg)->t;
    free(arg);
    uint_fast64_t seen = 0; /* gen at creation, not now: a job may have started already */
    for (;;) {
        /* spin a while, then sleep until a job (a new gen) or stop */
        const int64_t until = now_ns() + STRATA_SPIN_NS;
        int i = 0;
        while (atomic_load_explicit(&pool->gen, memory_order_acquire) == seen &&
               !atomic_load_explicit(&pool->stop, memory_order_relaxed)) {
            cpu_relax();
            if (++i % 64 == 0 && now_ns() > until) {
                pthread_mutex_lock(&pool->mu);
                atomic_fetch_add(&pool->sleepers, 1); /* seq_cst: pairs with strata_run_job */
                while (atomic_load(&pool->gen) == seen && !atomic_load(&pool->stop))
                    pthread_cond_wait(&pool->cv, &pool->mu);
                atomic_fetch_sub(&pool->sleepers, 1);
                pthread_mutex_unlock(&pool->mu);
            }
        }
        /* a stopped pool's server has ended (pool_stop joins it first), so no job starts now;
         * one that started before the stop has been seen here */
        const uint_fast64_t gen = atomic_load_explicit(&pool->gen, memory_order_acquire);
        if (gen == seen) return NULL; /* stopped, no job */
        seen = gen;
        run_share(pool, t);
    }
}

/* Ends the server, then the workers. In that order: a job the server starts waits for every
 * worker at its barriers, so a worker must not leave while a server may still start one (a
 * worker that saw `stop` just before the server bumped `gen` would leave it waiting forever). */
static void pool_stop(strata_pool *pool) {
    if (pool->serving) {
        pthread_mutex_lock(&pool->mu);
        atomic_store(&pool->halt, 1);
        pthread_cond_broadcast(&pool->scv);
        pthread_mutex_unlock(&pool->mu);
        pthread_join(pool->server_tid, NULL);
    }
    pthread_mutex_lock(&pool->mu);
    atomic_store(&pool->stop, 1);
    pthread_cond_broadcast(&pool->cv);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 0; i < pool->started; i++) pthread_join(pool->tids[i], NULL);
    free(pool->served);
    pthread_cond_destroy(&pool->scv);
    pthread_cond_destroy(&pool->cv);
    pthread_mutex_destroy(&pool->mu);
    free(pool->sums);
    free(pool->bytes);
    free(pool->tids);
    free(pool);
}

/* A pool of threads - 1 workers (the caller of a job is the last thread); NULL if threads < 1 or
 * a thread could not start. */
strata_pool *strata_pool_new(int threads) {
    if (threads < 1) return NULL;
    strata_pool *pool = aligned_alloc(64, (sizeof(strata_pool) + 63) / 64 * 64);
    if (!pool) return NULL;
    memset(pool, 0, sizeof *pool);
    pool->nthreads = threads;
    pool->tids = calloc((size_t)threads, sizeof(pthread_t));
    if (!pool->tids || pthread_mutex_init(&pool->mu, NULL) || pthread_cond_init(&pool->cv, NULL) ||
        pthread_cond_init(&pool->scv, NULL)) {
        free(pool->tids);
        free(pool);
        return NULL;
    }
    atomic_init(&pool->gen, 0);
    atomic_init(&pool->sleepers, 0);
    atomic_init(&pool->stop, 0);
    atomic_init(&pool->arrived1, 0);
    atomic_init(&pool->arrived2, 0);
    atomic_init(&pool->jobs, 0);
    atomic_init(&pool->busy_ns, 0);
    atomic_init(&pool->phase1_ns, 0);
    atomic_init(&pool->armed_until, 0);
    atomic_init(&pool->server_sleeping, 0);
    atomic_init(&pool->halt, 0);
    /* the workers take no signals: those are for the process's own threads */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int ok = 1;
    for (int t = 1; t < threads && ok; t++) {
        worker_arg *a = malloc(sizeof *a);
        ok = a != NULL;
        if (ok) {
            a->pool = pool;
            a->t = t;
            ok = pthread_create(&pool->tids[pool->started], NULL, worker, a) == 0;
            if (ok)
                pool->started++;
            else
                free(a);
        }
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (!ok) {
        pool_stop(pool);
        return NULL;
    }
    return pool;
}

/* Stops and joins the workers and frees the pool (NULL: nothing). No job of it may be running. */
void strata_pool_free(strata_pool *pool) {
    if (pool) pool_stop(pool);
}

/* Runs the job (a strata_job *) on its pool and returns once y is written. Reads n,
 * wts, offs and h now. Not reentrant per pool: the caller runs one job of a pool at a time. */
void strata_run_job(void *arg) {
    const int64_t t0 = now_ns();
    const strata_job *job = arg;
    strata_pool *pool = job->pool;
    int n = *(const volatile int32_t *)job->n;
    n = n < 0 ? 0 : n > job->kmax ? job->kmax : n;
    /* the sums, then the quantised inputs' scales and group sums, in one float store; their
     * values, then (LEVEL_SUMS) their sums by 4, in one byte store */
    const size_t hn = (size_t)job->D / 32, an = (size_t)job->kmax * job->F / 32;
    const size_t need = hn + an + 4 * (hn + an) + 1, nbytes = (LEVEL_SUMS + 1) * 32 * (hn + an) + 1;
    if (need > pool->sums_cap || nbytes > pool->bytes_cap) { /* a new shape: no thread reads */
        float *grown = realloc(pool->sums, need * sizeof(float));
        if (grown) pool->sums = grown, pool->sums_cap = need;
        int8_t *more = grown ? realloc(pool->bytes, nbytes) : NULL;
        if (more) pool->bytes = more, pool->bytes_cap = nbytes;
        if (!more) n = -1;
    }
    const qtype_info *tg = type_info(job->gate.qtype), *tu = type_info(job->up.qtype),
                     *td = type_info(job->down.qtype);
    if (!tg || !tu || !td) n = -1;
    if (n <= 0) { /* zeros; NaN for a type it cannot compute or scratch it could not allocate */
        for (int i = 0; i < job->D; i++) job->y[i] = n == 0 ? 0.0f : NAN;
        return;
    }
    pool->job = job;
    pool->n = n;
    pool->hsums = pool->sums;
    pool->asums = pool->sums + hn;
    float *qf = pool->sums + hn + an;
    const int gi8 = tg->i8 || tu->i8;
    int32_t *qn = LEVEL_SUMS ? (int32_t *)(pool->bytes + 32 * (hn + an)) : NULL;
    pool->hq = gi8 ? (xq_t){pool->bytes, qf, qf + 2 * hn, qn} : (xq_t){0};
    pool->aq = td->i8 ? (xq_t){pool->bytes + 32 * hn, qf + 4 * hn, qf + 4 * hn + 2 * an,
                               qn ? qn + 8 * hn : NULL}
                      : (xq_t){0};
    if (!tg->i8 || !tu->i8) /* a float kernel reads h's unit sums */
        unit_sums(job->h, 0, (int64_t)hn, pool->hsums);
    if (gi8)
        quantize_units(job->h, 0, (int64_t)hn, (int64_t)hn, (int8_t *)pool->hq.q,
                       (float *)pool->hq.d, (float *)pool->hq.s, (int32_t *)pool->hq.n);
    if (pool->nthreads > 1) {
        atomic_store_explicit(&pool->arrived1, 0, memory_order_relaxed);
        atomic_store_explicit(&pool->arrived2, 0, memory_order_relaxed);
        atomic_fetch_add(&pool->gen, 1); /* seq_cst: publishes the above; pairs with sleepers */
        if (atomic_load(&pool->sleepers) > 0) {
            pthread_mutex_lock(&pool->mu);
            pthread_cond_broadcast(&pool->cv);
            pthread_mutex_unlock(&pool->mu);
        }
    }
    run_share(pool, 0);
    if (pool->nthreads > 1) wait_count(&pool->arrived2, pool->nthreads);
    const int64_t t2 = now_ns();
    atomic_fetch_add_explicit(&pool->jobs, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&pool->busy_ns, t2 - t0, memory_order_relaxed);
    atomic_fetch_add_explicit(&pool->phase1_ns, pool->t1 - t0, memory_order_relaxed);
}

/* What the pool's jobs took so far: out[0] jobs computed (n > 0), out[1] nanoseconds from a
 * job's start to its end (the caller's wall time), out[2] of those, the nanoseconds until every
 * thread had finished phase 1. Any thread may ask at any time. */
void strata_pool_stats(strata_pool *pool, int64_t out[3]) {
    out[0] = atomic_load_explicit(&pool->jobs, memory_order_relaxed);
    out[1] = atomic_load_explicit(&pool->busy_ns, memory_order_relaxed);
    out[2] = atomic_load_explicit(&pool->phase1_ns, memory_order_relaxed);
}

/* -- serving a device: jobs posted through a mailbox in page-locked memory --------------------
 *
 * A GPU kernel writes a job's request (its n, wts, offs and h) into the job's page-locked
 * buffers, which the GPU maps, then the job's index and, after a system-wide fence, a new `seq`;
 * a server thread of the pool sees `seq` change, runs that job and publishes `done = seq` once
 * y is written; a GPU kernel waits for `done` to reach the `seq` it posted and reads y. No driver
 * call lies between the two sides, so a post costs what a few PCIe reads and writes cost, not a
 * host function's round trip through the driver. At most one job is posted at a time (the
 * device waits for each answer before it posts again).
 *
 * The server spins while the pool is armed (strata_pool_arm, before each decode step) or a post
 * came recently, then polls every SERVE_POLL_NS for SERVE_QUIET_NS more, then sleeps until the
 * next arm: an idle pool burns no CPU, and a post that came while it slept is answered at the
 * next arm. */

#define SERVE_SPIN_NS 20000000LL  /* spin this long after the last post or arm's end */
#define SERVE_POLL_NS 2000000LL   /* then poll this often */
#define SERVE_QUIET_NS 2000000000LL /* for this long; then sleep until armed */

typedef struct {                      /* in page-locked memory the device maps; 192 bytes */
    _Alignas(64) int64_t seq;         /* the device: the last post (1, 2, ...) */
    int32_t job;                      /* the device: the served job it asks for */
    _Alignas(64) int64_t done;        /* the server: the last post answered */
    _Alignas(64) int32_t fault;       /* 1: the device gave up waiting; 2: a post of no job */
} strata_mailbox;

_Static_assert(sizeof(strata_mailbox) == 192, "the mailbox's layout is shared with Python");

/* The mailbox's field offsets and size, for the Python side (and so its kernels). */
void strata_mailbox_layout(int64_t out[5]) {
    out[0] = (int64_t)offsetof(strata_mailbox, seq);
    out[1] = (int64_t)offsetof(strata_mailbox, job);
    out[2] = (int64_t)offsetof(strata_mailbox, done);
    out[3] = (int64_t)offsetof(strata_mailbox, fault);
    out[4] = (int64_t)sizeof(strata_mailbox);
}

static int64_t mb_load(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

static void *server(void *arg) {
    strata_pool *pool = arg;
    strata_mailbox *mb = pool->mb;
    int64_t last = mb_load(&mb->done), recent = now_ns();
    for (int i = 0;; i++) {
        if (atomic_load_explicit(&pool->halt, memory_order_relaxed)) return NULL;
        const int64_t seq = mb_load(&mb->seq);
        if (seq != last) {
            const int32_t j = __atomic_load_n(&mb->job, __ATOMIC_ACQUIRE);
            if (j >= 0 && j < pool->n_served)
                strata_run_job((void *)pool->served[j]);
            else
                __atomic_store_n(&mb->fault, 2, __ATOMIC_RELAXED);
            last = seq;
            __atomic_store_n(&mb->done, seq, __ATOMIC_RELEASE);
            recent = now_ns();
            continue;
        }
        cpu_relax();
        if (i % 64 != 0) continue;
        const int64_t t = now_ns(), armed = atomic_load(&pool->armed_until);
        const int64_t since = t - (armed > recent ? armed : recent);
        if (since < SERVE_SPIN_NS) continue;
        /* quiet: poll, then sleep until armed (the armer sees `server_sleeping` and signals) */
        pthread_mutex_lock(&pool->mu);
        atomic_store(&pool->server_sleeping, 1); /* seq_cst: pairs with strata_pool_arm */
        if (atomic_load(&pool->armed_until) == armed && !atomic_load(&pool->halt) &&
            mb_load(&mb->seq) == last) {
            if (since < SERVE_QUIET_NS) {
                struct timespec ts;
                clock_gettime(CLOCK_REALTIME, &ts);
                ts.tv_nsec += SERVE_POLL_NS;
                if (ts.tv_nsec >= 1000000000) {
                    ts.tv_sec += 1;
                    ts.tv_nsec -= 1000000000;
                }
                pthread_cond_timedwait(&pool->scv, &pool->mu, &ts);
            } else {
                pthread_cond_wait(&pool->scv, &pool->mu);
            }
        }
        atomic_store(&pool->server_sleeping, 0);
        pthread_mutex_unlock(&pool->mu);
    }
}

/* Serve `n` jobs of this pool through the mailbox `mb` (page-locked, 64-byte aligned, zeroed or
 * left as a previous server left it): a server thread answers each post (job index < n) until
 * the pool is freed. The jobs and the mailbox must outlive the pool. 0 on success; -1: a job
 * of another pool, a pool already serving, or no memory or thread. */
int strata_pool_serve(strata_pool *pool, void *mb, const strata_job *const *jobs, int n) {
    if (pool->serving || n < 1 || !mb || ((uintptr_t)mb & 63)) return -1;
    for (int j = 0; j < n; j++)
        if (!jobs[j] || jobs[j]->pool != pool) return -1;
    pool->served = malloc((size_t)n * sizeof *jobs);
    if (!pool->served) return -1;
    memcpy(pool->served, jobs, (size_t)n * sizeof *jobs);
    pool->n_served = n;
    pool->mb = mb;
    atomic_store(&pool->armed_until, now_ns());
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    const int rc = pthread_create(&pool->server_tid, NULL, server, pool);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        free(pool->served);
        pool->served = NULL;
        return -1;
    }
    pool->serving = 1;
    return 0;
}

/* Keep the server spinning for the next `ns` nanoseconds (a decode step is about to post), and
 * wake it if it sleeps. Any thread, any time. */
void strata_pool_arm(strata_pool *pool, int64_t ns) {
    atomic_store(&pool->armed_until, now_ns() + ns); /* seq_cst: pairs with the server's sleep */
    if (atomic_load(&pool->server_sleeping)) {
        pthread_mutex_lock(&pool->mu);
        pthread_cond_broadcast(&pool->scv);
        pthread_mutex_unlock(&pool->mu);
    }
}
