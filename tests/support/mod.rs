//! Shared helpers for the golden-value tests: fixture paths and tolerance checks.
#![allow(dead_code)]

use std::path::PathBuf;

use tune::checkpoint::HostTensor;
use tune::checkpoint::safetensors_io::SafetensorsFile;

pub type Cpu = burn::backend::Flex;
pub type CpuAutodiff = burn::backend::Autodiff<burn::backend::Flex>;

pub fn fixture(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(path)
}

pub struct Reference(pub SafetensorsFile);

impl Reference {
    pub fn open(name: &str) -> Self {
        Self(SafetensorsFile::open(&fixture(&format!("reference/{name}"))).expect("reference file"))
    }
    pub fn f32(&self, name: &str) -> HostTensor {
        self.0.read(name).unwrap_or_else(|e| panic!("{name}: {e}"))
    }
    pub fn i64(&self, name: &str) -> Vec<i64> {
        self.0.read_i64(name).unwrap_or_else(|e| panic!("{name}: {e}"))
    }
    pub fn tokens(&self) -> (Vec<u32>, Vec<i64>, usize) {
        let ids = self.i64("input_ids");
        let labels = self.i64("labels");
        let shape = self.0.shape("input_ids").unwrap();
        (ids.iter().map(|&i| i as u32).collect(), labels, shape[0])
    }
    pub fn names(&self) -> Vec<String> {
        self.0.names()
    }
}

/// Largest |a - b|, after checking the shapes agree.
pub fn max_abs_diff(what: &str, got: &HostTensor, want: &HostTensor) -> f32 {
    assert_eq!(got.shape, want.shape, "{what}: shape");
    got.data.iter().zip(&want.data).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max)
}

/// Fixture tolerance for logits and losses: 1e-4 absolute.
pub fn assert_close(what: &str, got: &HostTensor, want: &HostTensor, tol: f32) {
    let d = max_abs_diff(what, got, want);
    assert!(d <= tol, "{what}: max abs diff {d} > {tol}");
}

/// Fixture tolerance for gradients: within 1e-4 absolute or 1e-3 relative, element-wise.
pub fn assert_grad_close(what: &str, got: &HostTensor, want: &HostTensor) {
    assert_eq!(got.shape, want.shape, "{what}: shape");
    for (i, (a, b)) in got.data.iter().zip(&want.data).enumerate() {
        let ok = (a - b).abs() <= 1e-4 || (a - b).abs() <= 1e-3 * b.abs();
        assert!(ok, "{what}[{i}]: got {a}, want {b}");
    }
}

/// Position ids 0..seq for each row.
pub fn positions(batch: usize, seq: usize) -> Vec<u32> {
    (0..batch).flat_map(|_| 0..seq as u32).collect()
}
