// Launcher that decode_attention.cu exports to the host .cpp: plain pointers and a stream only,
// so the CUDA source includes no torch headers.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/launch.h"

namespace fastawq {

// Keys per warp step: two mma n-tiles of 8 keys (QK), one k-step of 16 keys (PV).
constexpr int kDecodeTileN = 16;
constexpr int kDecodeWarps = 4;
// Query heads per KV head that one warp's m16n8k16 fragments hold (the PV mma's N).
constexpr int kDecodeMaxGroup = 8;
// Sequence splits per (row, KV head): bounds the partials the last block reads back.
constexpr int kDecodeMaxSplits = 32;
// The most splits in one cluster (FASTAWQ_ATTN_CLUSTER=1): the portable cluster size.
constexpr int kDecodeMaxCluster = 8;
// Keys a split takes at least, and the multiple it takes: one 16-key tile for each warp, so no
// warp of a working block idles (a 16-key split ran one warp of four).
constexpr int kDecodeSplitKeys = kDecodeWarps * kDecodeTileN;

struct DecodeAttentionArgs {
  HalfType dtype;
  const void* q;        // [B, HQ, D]
  void* k_cache;        // [B', S, HKV, D] (written by the rope form)
  void* v_cache;        // [B', S, HKV, D]
  const int* lens;      // [B] int32, read on the device
  void* out;            // [B, HQ, D]
  float* part_acc;      // [B, HKV, splits, group, D] fp32 when splits > 1
  float* part_ml;       // [B, HKV, splits, group, 2] fp32 (running max in log2 units, sum)
  int* counters;        // [B * HKV] zeroed; the kernel re-arms them
  int64_t q_sb, q_sh;
  int64_t k_sb, k_ss, k_sh;
  int64_t v_sb, v_ss, v_sh;
  int64_t o_sb, o_sh;
  int batch, seq_cap, hkv, group, head_dim, splits;
  int min_split_keys;   // a split takes at least this many keys (a multiple of kDecodeSplitKeys)
  bool prefetch_kv;     // bring the split's K and V rows into L2 before the PDL wait
  // FASTAWQ_ATTN_CLUSTER=1 (sm_90): clusters of this many splits (splits is a multiple of it, <= 8),
  // which combine in distributed shared memory when all working ones are in the first; 0: none.
  int cluster;
  float scale_log2;     // softmax scale * log2(e)
  // The rope form (rope_decode_attention): q points into qkv rows [B, (HQ + 2 HKV) D] (q_sb their
  // stride, q_sh = D), whose q heads are rotated in registers and whose new K (rotated) and V rows
  // go into the caches at positions[b] -- the work of rope_kv_cache, without its launch.
  bool rope;
  const int* positions;   // [B] int32
  const float* rope_cos;  // [rope_rows, D] fp32
  const float* rope_sin;
  const void* q_norm;     // [D] in q's dtype, or null (Qwen3's per-head RMSNorm before the rotation)
  const void* k_norm;
  float norm_eps;
  int rope_rows;
  int hq;                 // query heads (the K rows of qkv start at column hq * D)
  // The rope form only: q points into fp32 sums [B, (HQ + 2 HKV) D] (the QKV projection's, added by
  // awq_gemv_packed_sums; FASTAWQ_QKV_SUMS), rounded to dtype as read; q_sb, q_sh count floats.
  bool qkv_f32;
};

// Splits for a batch of `rows_heads` (B * HKV) pairs over a cache of `seq_cap` positions: about two
// blocks per SM, never fewer than kDecodeSplitKeys positions a split. Depends on no length, so a
// captured CUDA graph stays valid whatever lens holds at replay (the kernel sizes the splits by it).
inline int decode_attention_splits(int rows_heads, int seq_cap, int sms) {
  int want = (2 * sms + rows_heads - 1) / rows_heads;
  int tiles = (seq_cap + kDecodeSplitKeys - 1) / kDecodeSplitKeys;
  int s = want < tiles ? want : tiles;
  s = s < kDecodeMaxSplits ? s : kDecodeMaxSplits;
  return s < 1 ? 1 : s;
}

void launch_decode_attention(const DecodeAttentionArgs& args, cudaStream_t stream);

}  // namespace fastawq
