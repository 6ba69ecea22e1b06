/* BLAKE2b with an 8-byte digest (unkeyed, RFC 7693): the hash of llmobs's token-step span ids,
 * "step\x1f<pid>\x1f<trace hex>\x1f<step_seq>\x1f<batch row>" (llmobs.otlp.encoder.SpanIds), which both
 * the workload's thread-context library (shm/c/otel_thread_ctx.c, one step at a time) and the OTLP
 * encoder (otlp/c/wire_gather.c, a batch's steps at once) compute. One definition, included by both;
 * the unit tests hold each against hashlib. Little-endian hosts (x86-64, arm64). */
#ifndef LLMOBS_BLAKE2B_64_H
#define LLMOBS_BLAKE2B_64_H

#include <stdint.h>
#include <string.h>

static const uint64_t blake2b_iv[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};
static const uint8_t blake2b_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

static inline uint64_t rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

static void blake2b_compress(uint64_t h[8], const uint8_t block[128], uint64_t t, int last) {
  uint64_t m[16], v[16];
  for (int i = 0; i < 16; i++) memcpy(&m[i], block + 8 * i, 8); /* little-endian hosts (x86-64, arm64) */
  for (int i = 0; i < 8; i++) v[i] = h[i], v[i + 8] = blake2b_iv[i];
  v[12] ^= t;
  if (last) v[14] = ~v[14];
#define G(a, b, c, d, x, y)                                                                             \
  do {                                                                                                  \
    v[a] = v[a] + v[b] + (x); v[d] = rotr64(v[d] ^ v[a], 32);                                           \
    v[c] = v[c] + v[d];       v[b] = rotr64(v[b] ^ v[c], 24);                                           \
    v[a] = v[a] + v[b] + (y); v[d] = rotr64(v[d] ^ v[a], 16);                                           \
    v[c] = v[c] + v[d];       v[b] = rotr64(v[b] ^ v[c], 63);                                           \
  } while (0)
  for (int r = 0; r < 12; r++) {
    const uint8_t *s = blake2b_sigma[r];
    G(0, 4, 8, 12, m[s[0]], m[s[1]]);
    G(1, 5, 9, 13, m[s[2]], m[s[3]]);
    G(2, 6, 10, 14, m[s[4]], m[s[5]]);
    G(3, 7, 11, 15, m[s[6]], m[s[7]]);
    G(0, 5, 10, 15, m[s[8]], m[s[9]]);
    G(1, 6, 11, 12, m[s[10]], m[s[11]]);
    G(2, 7, 8, 13, m[s[12]], m[s[13]]);
    G(3, 4, 9, 14, m[s[14]], m[s[15]]);
  }
#undef G
  for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* BLAKE2b with an 8-byte digest of text[0..len). */
static void blake2b_64(const uint8_t *text, uint32_t len, uint8_t out[8]) {
  uint64_t h[8];
  uint8_t block[128];
  memcpy(h, blake2b_iv, sizeof h);
  h[0] ^= 0x01010000ULL ^ 8; /* no key, 8-byte digest */
  uint64_t done = 0;
  while (len - done > 128) {
    blake2b_compress(h, text + done, done + 128, 0);
    done += 128;
  }
  memset(block, 0, sizeof block);
  memcpy(block, text + done, len - done);
  blake2b_compress(h, block, len, 1);
  memcpy(out, &h[0], 8);
}

/* The decimal digits of v (as Python's str(int) writes it, '-' first when negative) at out; their
 * count (at most 20). */
static inline uint32_t llmobs_decimal(int64_t v, uint8_t *out) {
  uint8_t digits[20];
  uint32_t n = 0, len = 0;
  uint64_t magnitude = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
  do digits[n++] = (uint8_t)('0' + magnitude % 10), magnitude /= 10; while (magnitude);
  if (v < 0) out[len++] = '-';
  while (n) out[len++] = digits[--n];
  return len;
}

#endif
