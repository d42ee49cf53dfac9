//! Learning-rate schedules as torchtune/transformers define them, as a pure function of the
//! optimizer step, so resuming needs nothing but the step count.

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Schedule {
    Constant,
    /// `get_cosine_schedule_with_warmup`: linear warm-up, then a cosine with `num_cycles`.
    CosineWithWarmup {
        warmup: usize,
        num_cycles: f64,
    },
    /// Linear warm-up, then linear decay to zero at the last step.
    LinearWithWarmup {
        warmup: usize,
    },
    ConstantWithWarmup {
        warmup: usize,
    },
}

impl Schedule {
    /// The multiplier of the base learning rate at optimizer step `step` (0-based) of `total`.
    pub fn factor(&self, step: usize, total: usize) -> f64 {
        let warm = |w: usize| {
            if step < w {
                Some(step as f64 / w.max(1) as f64)
            } else {
                None
            }
        };
        match *self {
            Self::Constant => 1.0,
            Self::ConstantWithWarmup { warmup } => warm(warmup).unwrap_or(1.0),
            Self::LinearWithWarmup { warmup } => warm(warmup).unwrap_or_else(|| {
                ((total.saturating_sub(step)) as f64 / (total.saturating_sub(warmup)).max(1) as f64)
                    .max(0.0)
            }),
            Self::CosineWithWarmup { warmup, num_cycles } => warm(warmup).unwrap_or_else(|| {
                let progress =
                    (step - warmup) as f64 / (total.saturating_sub(warmup)).max(1) as f64;
                (0.5 * (1.0 + (std::f64::consts::PI * num_cycles * 2.0 * progress).cos())).max(0.0)
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cosine_matches_torchtune() {
        let s = Schedule::CosineWithWarmup {
            warmup: 10,
            num_cycles: 0.5,
        };
        assert_eq!(s.factor(0, 100), 0.0);
        assert!((s.factor(5, 100) - 0.5).abs() < 1e-12);
        assert!((s.factor(10, 100) - 1.0).abs() < 1e-12);
        assert!((s.factor(55, 100) - 0.5).abs() < 1e-12);
        assert!(s.factor(100, 100).abs() < 1e-12);
    }

    #[test]
    fn linear_decays_to_zero() {
        let s = Schedule::LinearWithWarmup { warmup: 2 };
        assert_eq!(s.factor(1, 10), 0.5);
        assert_eq!(s.factor(2, 10), 1.0);
        assert_eq!(s.factor(10, 10), 0.0);
    }
}
