//! A checkpoint's `preprocessor_config.json`: which image processor the model was trained
//! with and its settings, read as transformers reads them (its defaults for what the file
//! leaves out). A setting tune does not carry out is refused by name, never ignored.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::gemma3::{Gemma3ImageProcessor, PanAndScan};
use super::qwen2_vl::Qwen2VlImageProcessor;
use super::resize::Filter;

/// The file's name beside the model's config.json.
pub const PREPROCESSOR_CONFIG: &str = "preprocessor_config.json";

#[derive(Debug, thiserror::Error)]
pub enum PreprocessorError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: `{key}` is {found}; expected {expected}")]
    Invalid {
        path: PathBuf,
        key: String,
        found: String,
        expected: &'static str,
    },
    #[error("{path}: `{key}: {found}` is not supported: {why}")]
    Unsupported {
        path: PathBuf,
        key: String,
        found: String,
        why: &'static str,
    },
}

/// An image processor tune carries out.
#[derive(Debug, Clone, PartialEq)]
pub enum ImageProcessor {
    Qwen2Vl(Qwen2VlImageProcessor),
    Gemma3(Gemma3ImageProcessor),
}

impl ImageProcessor {
    /// The transformers class it is.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Qwen2Vl(_) => "Qwen2VLImageProcessor",
            Self::Gemma3(_) => "Gemma3ImageProcessor",
        }
    }

    /// Reads `dir/preprocessor_config.json`.
    pub fn read(dir: &Path) -> Result<Self, PreprocessorError> {
        let path = dir.join(PREPROCESSOR_CONFIG);
        let text = std::fs::read_to_string(&path).map_err(|source| PreprocessorError::Read {
            path: path.clone(),
            source,
        })?;
        let value: Value =
            serde_json::from_str(&text).map_err(|source| PreprocessorError::Json {
                path: path.clone(),
                source,
            })?;
        let Some(map) = value.as_object() else {
            return Err(invalid(&path, "", &value, "a JSON object"));
        };
        Self::from_map(map, &path)
    }

    fn from_map(map: &Map<String, Value>, path: &Path) -> Result<Self, PreprocessorError> {
        let f = Fields { map, path };
        f.refuse_false("do_resize", "the vision tower takes the processor's sizes")?;
        f.refuse_false("do_rescale", "tune always rescales by `rescale_factor`")?;
        f.refuse_false(
            "do_normalize",
            "tune always normalises with `image_mean`/`image_std`",
        )?;
        f.refuse_false("do_convert_rgb", "tune always converts to RGB")?;
        let kind = f.string("image_processor_type")?;
        match kind
            .as_deref()
            .map(|k| k.trim_end_matches("Fast").trim_end_matches("Pil"))
        {
            Some("Qwen2VLImageProcessor") | Some("Qwen2_5_VLImageProcessor") => {
                let d = Qwen2VlImageProcessor::default();
                let size = map.get("size").and_then(Value::as_object);
                let edge = |key: &str| size.and_then(|s| s.get(key)).and_then(Value::as_u64);
                Ok(Self::Qwen2Vl(Qwen2VlImageProcessor {
                    min_pixels: f
                        .usize("min_pixels")?
                        .or(edge("shortest_edge").map(|v| v as usize))
                        .unwrap_or(d.min_pixels),
                    max_pixels: f
                        .usize("max_pixels")?
                        .or(edge("longest_edge").map(|v| v as usize))
                        .unwrap_or(d.max_pixels),
                    patch_size: f.usize("patch_size")?.unwrap_or(d.patch_size),
                    temporal_patch_size: f
                        .usize("temporal_patch_size")?
                        .unwrap_or(d.temporal_patch_size),
                    merge_size: f.usize("merge_size")?.unwrap_or(d.merge_size),
                    resample: f.resample()?.unwrap_or(d.resample),
                    rescale_factor: f.number("rescale_factor")?.unwrap_or(d.rescale_factor),
                    image_mean: f.triple("image_mean")?.unwrap_or(d.image_mean),
                    image_std: f.triple("image_std")?.unwrap_or(d.image_std),
                }))
            }
            Some("Gemma3ImageProcessor") => {
                let size = map.get("size").and_then(Value::as_object);
                let side = |key: &str| size.and_then(|s| s.get(key)).and_then(Value::as_u64);
                let (h, w) = (side("height").unwrap_or(224), side("width").unwrap_or(224));
                if h != w {
                    return Err(PreprocessorError::Unsupported {
                        path: path.to_path_buf(),
                        key: "size".into(),
                        found: format!("{h}x{w}"),
                        why: "Gemma 3's SigLIP takes a square",
                    });
                }
                // Pan and scan's defaults are Gemma3Processor's `images_kwargs` (its image
                // processor alone has none and fails without them); the size's, 224, the
                // image processor's (the Hub's files say 896).
                let pan_and_scan = match map.get("do_pan_and_scan") {
                    Some(Value::Bool(true)) => Some(PanAndScan {
                        min_crop_size: f.usize("pan_and_scan_min_crop_size")?.unwrap_or(256),
                        max_num_crops: f.usize("pan_and_scan_max_num_crops")?.unwrap_or(4),
                        min_ratio_to_activate: f
                            .number("pan_and_scan_min_ratio_to_activate")?
                            .unwrap_or(1.2),
                    }),
                    _ => None,
                };
                Ok(Self::Gemma3(Gemma3ImageProcessor {
                    size: h as usize,
                    pan_and_scan,
                    resample: f.resample()?.unwrap_or(Filter::Bilinear),
                    rescale_factor: f.number("rescale_factor")?.unwrap_or(1.0 / 255.0),
                    image_mean: f.triple("image_mean")?.unwrap_or([0.5; 3]),
                    image_std: f.triple("image_std")?.unwrap_or([0.5; 3]),
                }))
            }
            other => Err(PreprocessorError::Unsupported {
                path: path.to_path_buf(),
                key: "image_processor_type".into(),
                found: other.unwrap_or("(missing)").to_string(),
                why: "tune has Qwen2VLImageProcessor (Qwen2-VL, Qwen2.5-VL) and Gemma3ImageProcessor",
            }),
        }
    }
}

fn invalid(path: &Path, key: &str, found: &Value, expected: &'static str) -> PreprocessorError {
    PreprocessorError::Invalid {
        path: path.to_path_buf(),
        key: key.to_string(),
        found: found.to_string(),
        expected,
    }
}

/// Typed reads of the file's keys (`null` and absent alike: transformers' default).
struct Fields<'a> {
    map: &'a Map<String, Value>,
    path: &'a Path,
}

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn string(&self, key: &str) -> Result<Option<String>, PreprocessorError> {
        self.get(key)
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| invalid(self.path, key, v, "a string"))
            })
            .transpose()
    }

    fn usize(&self, key: &str) -> Result<Option<usize>, PreprocessorError> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .filter(|&n| n > 0)
                    .map(|n| n as usize)
                    .ok_or_else(|| invalid(self.path, key, v, "a positive integer"))
            })
            .transpose()
    }

    fn number(&self, key: &str) -> Result<Option<f64>, PreprocessorError> {
        self.get(key)
            .map(|v| {
                v.as_f64()
                    .filter(|x| x.is_finite() && *x > 0.0)
                    .ok_or_else(|| invalid(self.path, key, v, "a positive number"))
            })
            .transpose()
    }

    fn triple(&self, key: &str) -> Result<Option<[f32; 3]>, PreprocessorError> {
        self.get(key)
            .map(|v| {
                let values: Option<Vec<f32>> = match v {
                    Value::Array(a) if a.len() == 3 => {
                        a.iter().map(|x| x.as_f64().map(|x| x as f32)).collect()
                    }
                    other => other.as_f64().map(|x| vec![x as f32; 3]),
                };
                values
                    .map(|v| [v[0], v[1], v[2]])
                    .ok_or_else(|| invalid(self.path, key, v, "a number or three numbers"))
            })
            .transpose()
    }

    /// PIL's resampling constants: 2 BILINEAR, 3 BICUBIC.
    fn resample(&self) -> Result<Option<Filter>, PreprocessorError> {
        match self.get("resample") {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(2) => Ok(Some(Filter::Bilinear)),
                Some(3) => Ok(Some(Filter::Bicubic)),
                _ => Err(PreprocessorError::Unsupported {
                    path: self.path.to_path_buf(),
                    key: "resample".into(),
                    found: v.to_string(),
                    why: "tune resamples with Pillow's BILINEAR (2) and BICUBIC (3)",
                }),
            },
        }
    }

    fn refuse_false(&self, key: &str, why: &'static str) -> Result<(), PreprocessorError> {
        match self.get(key) {
            Some(Value::Bool(false)) => Err(PreprocessorError::Unsupported {
                path: self.path.to_path_buf(),
                key: key.into(),
                found: "false".into(),
                why,
            }),
            _ => Ok(()),
        }
    }
}
