//! Rows with images for a vision-language model (the tiny Qwen2-VL in assets/): messages with
//! image parts rendered by the checkpoint's chat template as transformers renders them, each
//! placeholder expanded to its image's tokens and never trained, batches of images of other
//! sizes with their M-RoPE positions, refusals that name the row and file, and the built-in
//! `tiny/vision_lora_single_device` training.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use tune::data::images::{ImagePlan, ImagesError};
use tune::data::{
    ConversationStyle, DataError, Dataset, DatasetKind, DatasetSpec, IGNORE_INDEX, Row, Samples,
};
use tune::tokenizer::Tokenizer;

use crate::support::{first_and_last_mean, run_recipe, temp_dir};

const IMAGE_PAD: u32 = 2010;

fn asset(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("assets")
        .join(rel)
}

fn plan() -> ImagePlan {
    let args = tune::models::ModelArgs::from_file(&asset("tiny-qwen2-vl/config.json")).unwrap();
    tune::setup::data::image_plan(&asset("tiny-qwen2-vl"), &args)
        .unwrap()
        .expect("Qwen2-VL reads images")
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_path(asset("tiny-qwen2-vl/tokenizer.json")).unwrap()
}

fn chat_spec(images: Option<ImagePlan>) -> DatasetSpec {
    let mut spec = DatasetSpec::new(DatasetKind::Chat);
    spec.conversation_style = ConversationStyle::Openai;
    spec.images = images;
    spec.image_dir = Some(asset("images"));
    spec
}

/// Rows as if read from assets/data/rows.json (their image paths are relative to `image_dir`,
/// the shipped images).
fn rows(values: Vec<Value>) -> Vec<Row> {
    Row::inline(&asset("data/rows.json").display().to_string(), values)
}

fn question(image: Value, answer: &str) -> Value {
    json!({"messages": [
        {"role": "user", "content": [image, {"type": "text", "text": "What colour is the shape?"}]},
        {"role": "assistant", "content": answer},
    ]})
}

fn build(values: Vec<Value>, max_seq_len: Option<usize>) -> Result<Dataset, DataError> {
    Dataset::from_rows(
        &rows(values),
        &chat_spec(Some(plan())),
        &tokenizer(),
        max_seq_len,
    )
}

fn sft(ds: &Dataset) -> &[tune::data::SftSample] {
    match ds.samples() {
        Samples::Sft(v) => v,
        _ => panic!("SFT samples"),
    }
}

/// transformers' `apply_chat_template` on this row, tokenized (tests/fixtures's tiny Qwen2-VL
/// template, printed by transformers 5.25): the placeholder once, before the text.
const RENDERED: &[u32] = &[
    2006, 115, 121, 322, 398, 10, 1539, 470, 258, 1444, 933, 1940, 511, 446, 46, 2007, 10, 2006,
    477, 273, 10, 2008, 2010, 2009, 1532, 665, 108, 711, 351, 262, 768, 706, 63, 2007, 10, 2006,
    520, 511, 446, 10, 1806, 351, 1090, 46, 2007, 10,
];

#[test]
fn an_image_part_becomes_its_tokens_none_of_them_trained() {
    let image = json!({"type": "image", "path": "red_circle.png"});
    let ds = build(vec![question(image, "It is red.")], Some(128)).unwrap();
    let sample = &sft(&ds)[0];
    let plan = plan();
    let decoded = tune::vision::DecodedImage::open(&asset("images/red_circle.png")).unwrap();
    let patches = plan.processor.process(&decoded, "red_circle").unwrap();
    let n = patches.patches() / 4;
    assert!(n > 1, "the test needs an image of several tokens");
    let expected: Vec<u32> = RENDERED
        .iter()
        .flat_map(|&t| std::iter::repeat_n(t, if t == IMAGE_PAD { n } else { 1 }))
        .collect();
    assert_eq!(sample.tokens, expected);
    let trained: Vec<u32> = sample
        .tokens
        .iter()
        .zip(&sample.labels)
        .filter(|(_, l)| **l != IGNORE_INDEX)
        .map(|(t, _)| *t)
        .collect();
    assert_eq!(
        trained,
        [1806, 351, 1090, 46, 2007, 10],
        "only the answer trains"
    );
    assert_eq!(sample.images.len(), 1);
    assert_eq!(sample.images[0].tokens, n);
    // Without `image_dir` a relative path is the working directory's, as torchtune reads it.
    let mut spec = chat_spec(Some(plan.clone()));
    spec.image_dir = None;
    let rel = json!({"type": "image", "path": "assets/images/red_circle.png"});
    let ds = Dataset::from_rows(
        &rows(vec![question(rel, "It is red.")]),
        &spec,
        &tokenizer(),
        Some(128),
    )
    .unwrap();
    assert_eq!(sft(&ds)[0].tokens, sample.tokens);
}

/// Two rows of other image sizes and a text-only row in one batch: every image's pixels in
/// row order, each row's M-RoPE positions, and the model runs on it.
#[test]
fn a_batch_holds_each_rows_images_and_positions() {
    let ds = build(
        vec![
            question(json!({"type": "image", "path": "red_circle.png"}), "It is red."),
            json!({"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}]}),
            json!({"messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this?"}]},
                {"role": "assistant", "content": "Blue."}],
                "images": ["blue_square.png"]}),
        ],
        Some(128),
    )
    .unwrap();
    let batch = ds.collate(&[0, 1, 2]).unwrap();
    let images = batch.images.as_ref().expect("the batch has images");
    let plan = plan();
    let grid = |name: &str| {
        let d = tune::vision::DecodedImage::open(&asset(&format!("images/{name}"))).unwrap();
        plan.processor.process(&d, name).unwrap().grid_thw
    };
    assert_eq!(
        images.grids,
        vec![grid("red_circle.png"), grid("blue_square.png")]
    );
    assert_ne!(images.grids[0], images.grids[1], "images of other sizes");
    assert_eq!(images.pixels.len(), images.patches() * 1176);
    assert_eq!(images.positions.len(), 3 * batch.tokens.len());
    // The text-only row's three sections are its plain positions.
    let seq = batch.seq_len;
    for section in 0..3 {
        let at = section * batch.tokens.len() + seq;
        let real = sft(&ds)[1].len();
        let want: Vec<u32> = (0..real as u32).collect();
        assert_eq!(images.positions[at..at + real], want[..]);
    }
    let model = tune::model_io::hf::load_model::<crate::support::Cpu>(
        &asset("tiny-qwen2-vl"),
        None,
        &Default::default(),
    )
    .unwrap()
    .model;
    let logits = model.forward(
        tune::training::sft::token_batch(&batch),
        tune::modules::ForwardMode::default(),
    );
    let loss = tune::training::loss::cross_entropy(logits, &batch.labels);
    let value = loss.into_scalar();
    assert!(value.is_finite() && value > 0.0, "loss {value}");
}

fn refusal(values: Vec<Value>, max_seq_len: Option<usize>) -> String {
    build(values, max_seq_len).expect_err("refused").to_string()
}

#[test]
fn bad_images_are_refused_naming_row_and_file() {
    // A corrupt image: its file named, and the row.
    let dir = temp_dir("bad-image");
    let corrupt = dir.path().join("corrupt.png");
    std::fs::write(&corrupt, b"\x89PNG\r\n\x1a\nnot really").unwrap();
    let msg = refusal(
        vec![question(
            json!({"type": "image", "path": corrupt.display().to_string()}),
            "x",
        )],
        Some(128),
    );
    assert!(
        msg.contains("rows.json: row 0") && msg.contains("corrupt.png"),
        "{msg}"
    );
    // A missing file.
    let msg = refusal(
        vec![question(
            json!({"type": "image", "path": "nowhere.png"}),
            "x",
        )],
        Some(128),
    );
    assert!(
        msg.contains("row 0") && msg.contains("nowhere.png"),
        "{msg}"
    );
    // An image part with no path and no `images` column left for it.
    let msg = refusal(vec![question(json!({"type": "image"}), "x")], Some(128));
    assert!(msg.contains("no image left"), "{msg}");
    // More images in the column than parts.
    let mut row = question(json!({"type": "image"}), "x");
    row["images"] = json!(["red_circle.png", "red_square.png"]);
    let msg = refusal(vec![row], Some(128));
    assert!(
        msg.contains("`images` holds 2 images") && msg.contains("for 1 of them"),
        "{msg}"
    );
    // A bad cell of the `images` column, placed once: file, row, column and image.
    let mut row = question(json!({"type": "image"}), "x");
    row["images"] = json!([42]);
    let msg = refusal(vec![row], Some(128));
    assert!(
        msg.contains("rows.json: row 0: column `images`, image 0: expected an image path"),
        "{msg}"
    );
    // A URL: tune reads local files.
    let msg = refusal(
        vec![question(
            json!({"type": "image", "path": "https://example.com/a.png"}),
            "x",
        )],
        Some(128),
    );
    assert!(msg.contains("is a URL"), "{msg}");
}

/// An image is never cut: a sample that its image makes longer than max_seq_len is refused,
/// naming the row, where a text sample would be truncated.
#[test]
fn a_sample_its_image_makes_too_long_is_refused() {
    let image = json!({"type": "image", "path": "yellow_square.png"});
    let err = build(vec![question(image, "Yellow.")], Some(40)).expect_err("refused");
    let DataError::RowImages { row, source, .. } = &err else {
        panic!("{err}");
    };
    assert_eq!(*row, 0);
    assert!(
        matches!(
            **source,
            ImagesError::TooLong {
                max_seq_len: 40,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("an image is never cut"), "{err}");
}

#[test]
fn images_for_a_text_model_or_packing_are_refused() {
    let image = json!({"type": "image", "path": "red_circle.png"});
    let text_model = Dataset::from_rows(
        &rows(vec![question(image.clone(), "x")]),
        &chat_spec(None),
        &tokenizer(),
        Some(128),
    )
    .expect_err("refused")
    .to_string();
    assert!(text_model.contains("the model reads none"), "{text_model}");
    let mut spec = chat_spec(Some(plan()));
    spec.packed = true;
    let packed = Dataset::from_rows(
        &rows(vec![question(image, "x")]),
        &spec,
        &tokenizer(),
        Some(128),
    )
    .expect_err("refused")
    .to_string();
    assert!(packed.contains("`packed: true` with images"), "{packed}");
}

/// The built-in config trains the tiny Qwen2-VL on the tiny images: the loss falls.
#[test]
fn tiny_vision_lora_trains() {
    let out = temp_dir("vision-lora");
    let metrics = run_recipe(
        "lora_finetune_single_device",
        "tiny/vision_lora_single_device",
        &out,
        &[],
    );
    let losses = crate::support::column(&metrics, "loss");
    let (first, last) = first_and_last_mean(&losses);
    assert!(last < first - 1.0, "loss {first} -> {last}");
    assert!(
        out.path()
            .join("epoch_4/adapter_model.safetensors")
            .is_file()
    );
    assert!(
        out.path()
            .join("epoch_4/preprocessor_config.json")
            .is_file()
    );
}

fn sharegpt(image: Value, first: &str) -> Value {
    json!({"image": image, "conversations": [
        {"from": "human", "value": first}, {"from": "gpt", "value": "Red."}]})
}

fn sharegpt_spec(kind: DatasetKind, image_tag: Option<&str>) -> DatasetSpec {
    let mut spec = chat_spec(Some(plan()));
    spec.kind = kind;
    spec.conversation_style = ConversationStyle::Sharegpt;
    spec.image_tag = image_tag.map(String::from);
    spec
}

fn sharegpt_tokens(spec: &DatasetSpec, row: Value) -> Result<Vec<u32>, String> {
    Dataset::from_rows(&rows(vec![row]), spec, &tokenizer(), Some(128))
        .map(|ds| sft(&ds)[0].tokens.clone())
        .map_err(|e| e.to_string())
}

/// torchtune's ShareGPTToMessages: a ShareGPT row's `image` goes into its first user message,
/// at the `<image>` tag (chat_dataset), at multimodal_chat_dataset's `image_tag`, or before the
/// text when it has none: the same tokens as the OpenAI row with the image part there.
#[test]
fn sharegpt_rows_place_their_image_as_torchtune_does() {
    let openai = |parts: Value| {
        let row = json!({"messages": [
            {"role": "user", "content": parts}, {"role": "assistant", "content": "Red."}]});
        sharegpt_tokens(&chat_spec(Some(plan())), row).expect("builds")
    };
    let image = json!({"type": "image", "path": "red_circle.png"});
    let text = |t: &str| json!({"type": "text", "text": t});
    let before = openai(json!([image, text("What colour?")]));
    let between = openai(json!([text("Look: "), image, text("What colour?")]));
    assert_ne!(before, between);

    let chat = sharegpt_spec(DatasetKind::Chat, Some("<image>"));
    let row = sharegpt(json!("red_circle.png"), "<image>What colour?");
    assert_eq!(sharegpt_tokens(&chat, row).unwrap(), before);
    let row = sharegpt(json!("red_circle.png"), "Look: <image>What colour?");
    assert_eq!(sharegpt_tokens(&chat, row).unwrap(), between);
    // multimodal_chat_dataset with no image_tag: before the text, which keeps any literal tag.
    let mm = sharegpt_spec(DatasetKind::MultimodalChat, None);
    let row = sharegpt(json!("red_circle.png"), "What colour?");
    assert_eq!(sharegpt_tokens(&mm, row).unwrap(), before);
    let mm_tag = sharegpt_spec(DatasetKind::MultimodalChat, Some("[img]"));
    let row = sharegpt(json!("red_circle.png"), "Look: [img]What colour?");
    assert_eq!(sharegpt_tokens(&mm_tag, row).unwrap(), between);
    // A null image is a text-only row.
    let text_only = sharegpt_tokens(&mm, sharegpt(Value::Null, "What colour?")).unwrap();
    assert!(!text_only.contains(&plan().vision.image_token_id));

    // Refused, naming the row: tags that do not match the images, train_on_input, an `images`
    // column (torchtune reads `image`).
    let msg =
        sharegpt_tokens(&chat, sharegpt(json!("red_circle.png"), "What colour?")).unwrap_err();
    assert!(
        msg.contains("row 0") && msg.contains("0 `<image>` tags for the row's 1 images"),
        "{msg}"
    );
    let mut trains = chat.clone();
    trains.train_on_input = true;
    let msg = sharegpt_tokens(&trains, sharegpt(json!("red_circle.png"), "<image>x")).unwrap_err();
    assert!(msg.contains("train_on_input: true"), "{msg}");
    let row = json!({"images": ["red_circle.png"], "conversations": [
        {"from": "human", "value": "<image>x"}, {"from": "gpt", "value": "Red."}]});
    let msg = sharegpt_tokens(&chat, row).unwrap_err();
    assert!(
        msg.contains("`images` column") && msg.contains("column_map: {image: images}"),
        "{msg}"
    );
    // A missing image file, named.
    let msg = sharegpt_tokens(&chat, sharegpt(json!("nope.png"), "<image>x")).unwrap_err();
    assert!(msg.contains("row 0") && msg.contains("nope.png"), "{msg}");
}

/// torchtune's own placement (`make_sharegpt_images_fixture.py` ran torchtune 0.6.1's
/// ShareGPTToMessages on each case): the ShareGPT row gives the tokens and labels of the OpenAI
/// row holding torchtune's messages, the image at the part torchtune put it.
#[test]
fn sharegpt_images_go_where_torchtunes_sharegpt_to_messages_puts_them() {
    let text = std::fs::read_to_string(crate::support::fixture("sharegpt_images.json")).unwrap();
    let fixture: Value = serde_json::from_str(&text).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 6);
    let openai = chat_spec(Some(plan()));
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let tag = case["image_tag"].as_str();
        let kind = match case["builder"].as_str() {
            Some("multimodal_chat_dataset") => DatasetKind::MultimodalChat,
            Some("chat_dataset") => DatasetKind::Chat,
            other => panic!("{name}: builder {other:?}"),
        };
        let messages: Vec<Value> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let parts = m["content"].as_array().unwrap();
                let content = match parts.as_slice() {
                    [only] if only["type"] == "text" => only["text"].clone(),
                    _ => Value::Array(parts.clone()),
                };
                let masked = m["role"] != "assistant";
                assert_eq!(m["masked"].as_bool(), Some(masked), "{name}");
                json!({"role": m["role"], "content": content})
            })
            .collect();
        let sample = |spec: &DatasetSpec, row: Value| {
            let ds = Dataset::from_rows(&rows(vec![row]), spec, &tokenizer(), Some(256))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let s = &sft(&ds)[0];
            (s.tokens.clone(), s.labels.clone())
        };
        let want = sample(&openai, json!({ "messages": messages }));
        let got = sample(&sharegpt_spec(kind, tag), case["row"].clone());
        assert_eq!(got, want, "{name}");
        assert!(want.0.contains(&IMAGE_PAD), "{name}: the image is in");
    }
}
