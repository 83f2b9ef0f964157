//! Which format one tensor gets: its role in the model, the policy and its K.

use super::policy::WeightPolicy;
use kvstream_memory_contracts::backend::WeightDType;

/// The role of a tensor, as the loader asks for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// A 2-D linear weight of a decoder layer (policy `format`).
    DecoderLinear,
    /// `lm_head` or a linear weight of the MTP head (policy `effective_head`).
    Head,
    /// Everything else (norms, conv, `A_log`, `dt_bias`, GDN `in_proj_a`/`in_proj_b`): as stored.
    Kept,
}

/// The dtype a tensor gets and whether that is a fallback from the requested format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Decision {
    pub dtype: WeightDType,
    pub fallback: bool,
}

/// Decides the device dtype of a tensor of `dims` stored as `stored`.
///
/// Requested format `f` (from the role and policy): `f` when K fits it; else q8_0 when K % 32
/// == 0; else the stored dtype (both fallbacks). `Kept` tensors stay as stored, except a
/// quantized tensor that is not 2-D (a norm or conv stored quantized), which becomes f32.
pub(crate) fn decide(
    role: Role,
    stored: WeightDType,
    dims: &[usize],
    policy: &WeightPolicy,
) -> Decision {
    let want = match role {
        Role::DecoderLinear => policy.format,
        Role::Head => policy.effective_head(),
        Role::Kept => {
            let dtype = if stored.is_quantized() && dims.len() != 2 {
                WeightDType::F32
            } else {
                stored
            };
            return Decision {
                dtype,
                fallback: false,
            };
        }
    };
    let keep = Decision {
        dtype: stored,
        fallback: false,
    };
    let Some(f) = want else { return keep };
    if f == stored || f.storage_bytes(dims).is_ok() {
        return Decision {
            dtype: f,
            fallback: false,
        };
    }
    if WeightDType::Q8_0.storage_bytes(dims).is_ok() {
        Decision {
            dtype: WeightDType::Q8_0,
            fallback: true,
        }
    } else {
        Decision {
            dtype: stored,
            fallback: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use WeightDType::*;

    #[test]
    fn formats_follow_role_policy_and_k() {
        let p = WeightPolicy::new(Q4G128);
        let d = decide(Role::DecoderLinear, Bf16, &[64, 256], &p);
        assert_eq!((d.dtype, d.fallback), (Q4G128, false));
        let d = decide(Role::DecoderLinear, Bf16, &[64, 192], &p);
        assert_eq!((d.dtype, d.fallback), (Q8_0, true));
        let d = decide(Role::DecoderLinear, F32, &[64, 40], &p);
        assert_eq!((d.dtype, d.fallback), (F32, true));
        let d = decide(Role::Head, Bf16, &[512, 256], &p);
        assert_eq!((d.dtype, d.fallback), (Q8_0, false));
        let d = decide(Role::Kept, Bf16, &[64, 256], &p);
        assert_eq!((d.dtype, d.fallback), (Bf16, false));
        let d = decide(Role::Kept, F8E4M3, &[64], &p);
        assert_eq!(d.dtype, F32);
        // q8_0 decoder linears: the head stays as stored unless overridden.
        let p = WeightPolicy::new(Q8_0);
        assert_eq!(decide(Role::Head, Bf16, &[512, 256], &p).dtype, Bf16);
        let p = p.with_head(F8E4M3);
        assert_eq!(decide(Role::Head, Bf16, &[512, 100], &p).dtype, F8E4M3);
        // As stored: nothing changes, even a pre-quantized tensor.
        let p = WeightPolicy::as_stored();
        assert_eq!(
            decide(Role::DecoderLinear, Q4G128, &[8, 128], &p).dtype,
            Q4G128
        );
        assert!(p.is_as_stored());
    }

    #[test]
    fn q4_nl_policy_is_the_q4_policy() {
        let p = WeightPolicy::new(Q4NlG128);
        assert_eq!(p.effective_head(), Some(Q8_0));
        let d = decide(Role::DecoderLinear, Bf16, &[64, 256], &p);
        assert_eq!((d.dtype, d.fallback), (Q4NlG128, false));
        let d = decide(Role::DecoderLinear, Bf16, &[64, 192], &p);
        assert_eq!((d.dtype, d.fallback), (Q8_0, true));
        let d = decide(Role::DecoderLinear, F32, &[64, 40], &p);
        assert_eq!((d.dtype, d.fallback), (F32, true));
        let d = decide(Role::Head, Bf16, &[512, 256], &p);
        assert_eq!((d.dtype, d.fallback), (Q8_0, false));
    }
}
