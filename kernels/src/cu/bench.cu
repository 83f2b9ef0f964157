// Micro-benchmark helpers: a vectorised streaming read of device memory (the HBM read roofline).

extern "C" __global__ void read_sum_f32(const float4* x, u64 n4, float* out) {
    float s = 0.0f;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n4; i += (u64)gridDim.x * blockDim.x) {
        float4 v = x[i];
        s += (v.x + v.y) + (v.z + v.w);
    }
    s = warp_sum(s);
    if ((threadIdx.x & 31) == 0) atomicAdd(out, s);
}
