/* Three-element adds done four wide, for conv.pyx's row2im: u[0..2] += s[0..2] with one
   vector load, add and store, the fourth lane adding +0.0 to u[3].

   The caller guarantees that s[3] and u[3] are in its arrays (it reads s[3] and writes u[3]
   back unchanged: a running sum that starts at +0.0 never becomes -0.0, so adding +0.0
   leaves it as it was, bit for bit). With GCC or Clang these are vector extensions (SSE2
   on x86-64, NEON on aarch64); elsewhere three scalar adds. */
#ifndef HPCDL_CONV_H
#define HPCDL_CONV_H
#include <string.h>

#if defined(__GNUC__) || defined(__clang__)
typedef float hpcdl_f4 __attribute__((vector_size(16)));
typedef double hpcdl_d4 __attribute__((vector_size(32)));

static inline void hpcdl_add3_f32(float *u, const float *s) {
    hpcdl_f4 a, b;
    memcpy(&a, u, sizeof a);
    memcpy(&b, s, sizeof b);
    b[3] = 0.0f;
    a += b;
    memcpy(u, &a, sizeof a);
}

static inline void hpcdl_add3_f64(double *u, const double *s) {
    hpcdl_d4 a, b;
    memcpy(&a, u, sizeof a);
    memcpy(&b, s, sizeof b);
    b[3] = 0.0;
    a += b;
    memcpy(u, &a, sizeof a);
}
#else
static inline void hpcdl_add3_f32(float *u, const float *s) {
    u[0] += s[0]; u[1] += s[1]; u[2] += s[2];
}

static inline void hpcdl_add3_f64(double *u, const double *s) {
    u[0] += s[0]; u[1] += s[1]; u[2] += s[2];
}
#endif
#endif
