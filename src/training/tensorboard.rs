//! A minimal TensorBoard event-file writer: scalar summaries only, which is all training
//! curves need. Records are TFRecord-framed `Event` protobufs, encoded by hand to avoid a
//! protobuf toolchain for three message types.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

pub struct EventWriter {
    out: BufWriter<File>,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn tag(field: u32, wire: u8, out: &mut Vec<u8>) {
    varint(((field as u64) << 3) | wire as u64, out);
}

fn bytes_field(field: u32, data: &[u8], out: &mut Vec<u8>) {
    tag(field, 2, out);
    varint(data.len() as u64, out);
    out.extend_from_slice(data);
}

/// TFRecord's masked CRC32-C.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

impl EventWriter {
    pub fn create(log_dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(log_dir)?;
        let host = std::fs::read_to_string("/etc/hostname").unwrap_or_else(|_| "localhost".into());
        let name = format!("events.out.tfevents.{}.{}", now() as u64, host.trim());
        let mut w = Self {
            out: BufWriter::new(File::create(log_dir.join(name))?),
        };
        // Event { wall_time = 1, file_version = 3 }
        let mut event = Vec::new();
        tag(1, 1, &mut event);
        event.extend_from_slice(&now().to_le_bytes());
        bytes_field(3, b"brain.Event:2", &mut event);
        w.record(&event)?;
        Ok(w)
    }

    fn record(&mut self, data: &[u8]) -> std::io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        self.out.write_all(&len)?;
        self.out.write_all(&masked_crc(&len).to_le_bytes())?;
        self.out.write_all(data)?;
        self.out.write_all(&masked_crc(data).to_le_bytes())
    }

    pub fn scalar(&mut self, name: &str, value: f32, step: i64) -> std::io::Result<()> {
        // Summary.Value { tag = 1, simple_value = 2 }
        let mut val = Vec::new();
        bytes_field(1, name.as_bytes(), &mut val);
        tag(2, 5, &mut val);
        val.extend_from_slice(&value.to_le_bytes());
        // Summary { value = 1 (repeated) }
        let mut summary = Vec::new();
        bytes_field(1, &val, &mut summary);
        // Event { wall_time = 1, step = 2, summary = 5 }
        let mut event = Vec::new();
        tag(1, 1, &mut event);
        event.extend_from_slice(&now().to_le_bytes());
        tag(2, 0, &mut event);
        varint(step as u64, &mut event);
        bytes_field(5, &summary, &mut event);
        self.record(&event)
    }

    pub fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}
