/* Copy with non-temporal (streaming) stores: for copies larger than the caches, as glibc's
   memcpy does above its threshold, the destination is written without being read first. */
#ifndef HPCDL_STREAM_H
#define HPCDL_STREAM_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
static inline void hpcdl_stream_copy(void *dst, const void *src, size_t n) {
    char *d = (char *)dst;
    const char *s = (const char *)src;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head; s += head; n -= head;
    for (size_t i = n / 64; i > 0; i--) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
        s += 64; d += 64;
    }
    memcpy(d, s, n & 63);
}
static inline void hpcdl_stream_fence(void) { _mm_sfence(); }
#else
static inline void hpcdl_stream_copy(void *dst, const void *src, size_t n) { memcpy(dst, src, n); }
static inline void hpcdl_stream_fence(void) {}
#endif
#endif
