//! `VisionOps`: bias add, LayerNorm, GELU and the ViT attention (rotary pass, then one warp per
//! (query row, head) with an online softmax over the frame's keys; vision.cu).

use super::pointwise::norm_rows;
use crate::launch::{args, grid1d};
use crate::types::elementwise_dtype_code;
use crate::{CudaBackend, CudaTensor, CudaWeight};
use cudarc::driver::LaunchConfig;
use kvstream_kernels::launch::{VISION_ATT_MAX_HEAD_DIM, VISION_ATT_WARPS};
use kvstream_memory_contracts::backend::DeviceTensor;
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::ops::{Gelu, VisionAttentionShape, VisionOps};

impl VisionOps for CudaBackend {
    fn add_bias(&self, x: &CudaTensor, b: &CudaWeight) -> Result<CudaTensor, OpError> {
        let (_, d) = norm_rows("add_bias", x, b)?;
        let out = self.tensor_uninit(&x.dims)?;
        let n = x.numel();
        if n == 0 {
            return Ok(out);
        }
        let f = self.func("add_bias_f32")?;
        let (xp, bp, dt, d64, yp, n64) = (
            x.ptr(),
            b.ptr(),
            elementwise_dtype_code("add_bias", b.dtype)?,
            d as u64,
            out.ptr(),
            n as u64,
        );
        let mut a = args![&xp, &bp, &dt, &d64, &yp, &n64];
        self.launch("add_bias", f, grid1d(n, 256), &mut a)?;
        Ok(out)
    }

    fn layer_norm(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        b: &CudaWeight,
        eps: f32,
    ) -> Result<CudaTensor, OpError> {
        let (rows, d) = norm_rows("layer_norm", x, w)?;
        if b.numel() != d {
            return Err(OpError::shape(
                "layer_norm",
                format!("weight has {d} values, bias {}", b.numel()),
            ));
        }
        let out = self.tensor_uninit(&x.dims)?;
        if rows == 0 {
            return Ok(out);
        }
        let f = self.func("layer_norm_f32")?;
        let (xp, wp, wdt, bp, bdt, d64, yp) = (
            x.ptr(),
            w.ptr(),
            elementwise_dtype_code("layer_norm", w.dtype)?,
            b.ptr(),
            elementwise_dtype_code("layer_norm", b.dtype)?,
            d as u64,
            out.ptr(),
        );
        let mut a = args![&xp, &wp, &wdt, &bp, &bdt, &d64, &eps, &yp];
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch("layer_norm", f, cfg, &mut a)?;
        Ok(out)
    }

    fn gelu(&self, x: &CudaTensor, kind: Gelu) -> Result<CudaTensor, OpError> {
        let out = self.tensor_uninit(&x.dims)?;
        let n = x.numel();
        if n == 0 {
            return Ok(out);
        }
        let f = self.func("gelu_f32")?;
        let k: i32 = match kind {
            Gelu::Tanh => 0,
            Gelu::Erf => 1,
        };
        let (xp, yp, n64) = (x.ptr(), out.ptr(), n as u64);
        let mut a = args![&xp, &yp, &n64, &k];
        self.launch("gelu", f, grid1d(n, 256), &mut a)?;
        Ok(out)
    }

    fn vision_attention(
        &self,
        qkv: &CudaTensor,
        cos: &CudaTensor,
        sin: &CudaTensor,
        shape: &VisionAttentionShape,
    ) -> Result<CudaTensor, OpError> {
        let op = "vision_attention";
        shape.check(op, qkv.numel(), cos.numel(), sin.numel())?;
        if shape.head_dim > VISION_ATT_MAX_HEAD_DIM || shape.heads > 65_535 {
            return Err(OpError::shape(
                op,
                format!(
                    "{shape:?}: the kernel takes head_dim <= {VISION_ATT_MAX_HEAD_DIM} and \
                     heads <= 65535"
                ),
            ));
        }
        let h = shape.heads * shape.head_dim;
        let out = self.tensor_uninit(&[shape.tokens, h])?;
        if shape.tokens == 0 || h == 0 {
            return Ok(out);
        }
        let rotated = self.tensor_uninit(&qkv.dims)?;
        let (n64, heads, hd, frame) = (
            shape.tokens as u64,
            shape.heads as i32,
            shape.head_dim as i32,
            shape.frame as u64,
        );
        let f = self.func("vision_rotary_f32")?;
        let (qp, cp, sp, rp) = (qkv.ptr(), cos.ptr(), sin.ptr(), rotated.ptr());
        let mut a = args![&qp, &cp, &sp, &rp, &n64, &heads, &hd, &frame];
        self.launch(op, f, grid1d(qkv.numel(), 256), &mut a)?;
        let blocks = shape.tokens.div_ceil(VISION_ATT_WARPS);
        let blocks = u32::try_from(blocks)
            .map_err(|_| OpError::shape(op, format!("{shape:?}: too many tokens")))?;
        let cfg = LaunchConfig {
            grid_dim: (blocks, shape.heads as u32, 1),
            block_dim: (32 * VISION_ATT_WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let scale = 1.0 / (shape.head_dim as f32).sqrt();
        let f = self.func("vision_attn_f32")?;
        let op_ptr = out.ptr();
        let mut a = args![&rp, &op_ptr, &n64, &heads, &hd, &frame, &scale];
        self.launch(op, f, cfg, &mut a)?;
        // `rotated` is freed on drop: the allocator orders the free after the launches on the
        // compute stream (stream-ordered allocation, as for every temporary here).
        drop(rotated);
        Ok(out)
    }
}
