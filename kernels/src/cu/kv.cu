// KV quantise-and-write: token i's K and V rows (f32 [n, kv_heads*head_dim]) encoded in the page
// format and written at byte offsets rows[2i] (K) and rows[2i+1] (V) of the pool. Encoding matches
// memory-contracts' kv::format bit for bit (GGML Q8_0 / Q4_0 blocks).

__device__ void encode_block(const float* x, int ty, int nvals, u8* out) {
    if (ty == KV_Q8_0) {
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        u16 dh = f32_to_f16(d);
        out[0] = (u8)(dh & 0xff);
        out[1] = (u8)(dh >> 8);
        for (int j = 0; j < QK; j++) {
            float r = roundf(__fmul_rn(x[j], id));
            r = fminf(fmaxf(r, -128.0f), 127.0f);
            int q = (r != r) ? 0 : (int)r;
            out[2 + j] = (u8)(i8)q;
        }
    } else if (ty == KV_Q4_0) {
        float amax = 0.0f, mx = 0.0f;
        for (int j = 0; j < QK; j++) {
            float a = fabsf(x[j]);
            if (amax < a) { amax = a; mx = x[j]; }
        }
        float d = mx / -8.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        u16 dh = f32_to_f16(d);
        out[0] = (u8)(dh & 0xff);
        out[1] = (u8)(dh >> 8);
        for (int j = 0; j < QK / 2; j++) {
            // __fmul_rn: no FMA contraction, so rounding matches the CPU encoder bit for bit.
            float x0 = truncf(__fmul_rn(x[j], id) + 8.5f);
            float x1 = truncf(__fmul_rn(x[QK / 2 + j], id) + 8.5f);
            int q0 = (x0 != x0) ? 0 : (int)fminf(fmaxf(x0, -128.0f), 127.0f);
            int q1 = (x1 != x1) ? 0 : (int)fminf(fmaxf(x1, -128.0f), 127.0f);
            q0 = q0 < 15 ? q0 : 15;
            q1 = q1 < 15 ? q1 : 15;
            out[2 + j] = (u8)((u8)q0 | ((u8)q1 << 4));
        }
    } else if (ty == KV_F16 || ty == KV_BF16) {
        for (int j = 0; j < nvals; j++) {
            u16 h = ty == KV_F16 ? f32_to_f16(x[j]) : f32_to_bf16(x[j]);
            out[2 * j] = (u8)(h & 0xff);
            out[2 * j + 1] = (u8)(h >> 8);
        }
    } else {
        for (int j = 0; j < nvals; j++) {
            u32 b = __float_as_uint(x[j]);
            out[4 * j] = (u8)b;
            out[4 * j + 1] = (u8)(b >> 8);
            out[4 * j + 2] = (u8)(b >> 16);
            out[4 * j + 3] = (u8)(b >> 24);
        }
    }
}

// One thread per (token, plane, 32-value group). row_values is a multiple of 32 for quantised types;
// for float types a group is min(32, remaining) values.
extern "C" __global__ void kv_write(const float* k, const float* v, u8* pool, const u64* rows, u64 n,
                                    int row_values, int k_type, int v_type, int k_block_bytes, int v_block_bytes) {
    int groups = (row_values + QK - 1) / QK;
    u64 total = n * 2 * (u64)groups;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        int grp = (int)(i % groups);
        int plane = (int)((i / groups) % 2);
        u64 tok = i / groups / 2;
        const float* src = (plane == 0 ? k : v) + tok * row_values + grp * QK;
        int ty = plane == 0 ? k_type : v_type;
        int nvals = row_values - grp * QK < QK ? row_values - grp * QK : QK;
        u64 base = rows[2 * tok + plane];
        // Byte offset of this group inside the row: quantised → one block per group; floats → per value.
        u64 off = (ty == KV_Q8_0 || ty == KV_Q4_0) ? (u64)grp * (plane == 0 ? k_block_bytes : v_block_bytes)
                                                   : (u64)grp * QK * (plane == 0 ? k_block_bytes : v_block_bytes);
        encode_block(src, ty, nvals, pool + base + off);
    }
}
