//! Generation through the library: greedy decoding against transformers' output, and the KV
//! cache path against recomputing the whole sequence each step.

use crate::support;

use burn::tensor::backend::Backend;
use support::*;
use tune::generation::{
    Decoder, GenerateError, GenerateOptions, SamplingParams, StopReason, generate, sampling::argmax,
};
use tune::model_io::hf::load_model;
use tune::models::CausalLm;

fn model(dir: &str) -> CausalLm<Cpu> {
    load_model::<Cpu>(&fixture(dir), None, &Default::default())
        .unwrap()
        .model
}

struct GenerateFixture {
    prompt: Vec<u32>,
    max_new_tokens: usize,
    expected: Vec<u32>,
}

fn reference() -> GenerateFixture {
    let text = std::fs::read_to_string(fixture("reference/generate.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |k: &str| -> Vec<u32> {
        json[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    GenerateFixture {
        prompt: ids("prompt_ids"),
        max_new_tokens: json["max_new_tokens"].as_u64().unwrap() as usize,
        expected: ids("greedy_output_ids"),
    }
}

fn greedy(max_new_tokens: usize, use_kv_cache: bool) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens,
        sampling: SamplingParams::GREEDY,
        seed: 0,
        stop_ids: vec![2004],
        stop_at_eos: false,
        use_kv_cache,
    }
}

#[test]
fn greedy_decoding_matches_transformers() {
    check_greedy_decoding::<Cpu>(&Default::default());
}

/// transformers' greedy tokens, with and without the KV cache, on `B`.
pub fn check_greedy_decoding<B: Backend>(device: &B::Device) {
    let r = reference();
    assert_eq!(r.max_new_tokens, 12);
    let lm = load_model::<B>(&fixture("tiny-llama"), None, device)
        .unwrap()
        .model;
    for use_kv_cache in [true, false] {
        let out = generate(
            &lm,
            &r.prompt,
            &greedy(r.max_new_tokens, use_kv_cache),
            |_| {},
        )
        .unwrap();
        let mut all = r.prompt.clone();
        all.extend(&out.tokens);
        assert_eq!(all, r.expected, "kv cache: {use_kv_cache}");
        assert_eq!(out.stop, StopReason::MaxNewTokens);
    }
}

/// Step by step: the cached decoder's last-position logits equal a full forward over the
/// whole sequence, and both choose the same greedy tokens.
fn cache_matches_full_recompute(dir: &str, prompt: &[u32]) {
    let lm = model(dir);
    let mut cached = Decoder::new(&lm, true);
    let mut full = Decoder::new(&lm, false);
    let (mut a, mut b) = (cached.feed(prompt).unwrap(), full.feed(prompt).unwrap());
    for step in 0..12 {
        let diff = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(diff <= 1e-4, "{dir} step {step}: logits differ by {diff}");
        let (ta, tb) = (argmax(&a), argmax(&b));
        assert_eq!(ta, tb, "{dir} step {step}: greedy tokens differ");
        a = cached.feed(&[ta]).unwrap();
        b = full.feed(&[tb]).unwrap();
    }
    assert_eq!(cached.len(), prompt.len() + 12);
}

#[test]
fn kv_cache_equals_full_forward_llama() {
    cache_matches_full_recompute("tiny-llama", &reference().prompt);
}

#[test]
fn kv_cache_equals_full_forward_qwen2_with_bias() {
    cache_matches_full_recompute("tiny-qwen2", &[17, 301, 5, 999, 42]);
}

/// Gemma 2 and 3 with a 5-token sliding window: the cached decode's mask must hide the keys
/// that slid out, and Gemma 3's sliding layers use their own RoPE base.
#[test]
fn kv_cache_equals_full_forward_gemma2_and_gemma3_sliding_windows() {
    let prompt = [17, 30, 5, 99, 42, 7, 8, 120];
    cache_matches_full_recompute("families/gemma2", &prompt);
    cache_matches_full_recompute("families/gemma3", &prompt);
}

/// `family`'s greedy tokens from reference/family-fixtures.json (transformers, KV cache),
/// with and without tune's cache, and the cached logits equal a full recompute at every step.
fn family_greedy_decoding_matches_transformers(family: &str) {
    let text = std::fs::read_to_string(fixture("reference/family-fixtures.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |k: &str| -> Vec<u32> {
        json[family]["greedy"][k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    let (prompt, expected) = (ids("prompt"), ids("tokens"));
    let dir = format!("families/{family}");
    let lm = model(&dir);
    for use_kv_cache in [true, false] {
        let mut opts = greedy(expected.len(), use_kv_cache);
        opts.stop_ids.clear();
        let out = generate(&lm, &prompt, &opts, |_| {}).unwrap();
        assert_eq!(out.tokens, expected, "{family}, kv cache: {use_kv_cache}");
    }
    cache_matches_full_recompute(&dir, &prompt);
}

/// SmolLM3's NoPE layers.
#[test]
fn smollm3_greedy_decoding_matches_transformers() {
    family_greedy_decoding_matches_transformers("smollm3");
}

/// Qwen3-MoE: each decoding step routes its one token through its own two experts.
#[test]
fn qwen3_moe_greedy_decoding_matches_transformers() {
    family_greedy_decoding_matches_transformers("qwen3_moe");
}

#[test]
fn mixtral_greedy_decoding_matches_transformers() {
    family_greedy_decoding_matches_transformers("mixtral");
}

/// gpt-oss: a decoding step's attention is the composed one, with the sinks.
#[test]
fn gpt_oss_greedy_decoding_matches_transformers() {
    family_greedy_decoding_matches_transformers("gpt_oss");
}

/// Qwen2-MoE: the gated shared expert on every decoded token beside its routed two.
#[test]
fn qwen2_moe_greedy_decoding_matches_transformers() {
    family_greedy_decoding_matches_transformers("qwen2_moe");
}

#[test]
fn stops_at_a_stop_token_unless_told_not_to() {
    let r = reference();
    let lm = model("tiny-llama");
    // Declare the third greedy token a stop token: generation ends right after emitting it.
    let third = r.expected[r.prompt.len() + 2];
    let mut opts = greedy(12, true);
    opts.stop_ids = vec![third];
    opts.stop_at_eos = true;
    let mut streamed = Vec::new();
    let out = generate(&lm, &r.prompt, &opts, |t| streamed.push(t)).unwrap();
    let first_hit = r.expected[r.prompt.len()..]
        .iter()
        .position(|&t| t == third)
        .unwrap();
    assert_eq!(
        out.tokens,
        r.expected[r.prompt.len()..r.prompt.len() + first_hit + 1]
    );
    assert_eq!(out.stop, StopReason::StopToken(third));
    assert_eq!(streamed, out.tokens);
    opts.stop_at_eos = false;
    assert_eq!(
        generate(&lm, &r.prompt, &opts, |_| {})
            .unwrap()
            .tokens
            .len(),
        12
    );
}

#[test]
fn seeded_sampling_is_reproducible() {
    let lm = model("tiny-llama");
    let prompt = reference().prompt;
    let run = |seed| {
        let opts = GenerateOptions {
            sampling: SamplingParams {
                temperature: 1.5,
                top_k: Some(200),
                top_p: Some(0.95),
            },
            seed,
            ..greedy(12, true)
        };
        generate(&lm, &prompt, &opts, |_| {}).unwrap().tokens
    };
    let a = run(11);
    assert_eq!(a, run(11));
    // At temperature 1.5 over 12 tokens, some seed among several must take another path.
    assert!((12..20).any(|s| run(s) != a), "sampling ignores the seed");
}

#[test]
fn bad_inputs_are_errors() {
    let lm = model("tiny-llama");
    let e = generate(&lm, &[], &greedy(4, true), |_| {}).unwrap_err();
    assert!(matches!(e, GenerateError::EmptyPrompt), "{e}");
    let e = generate(&lm, &[1, 5000], &greedy(4, true), |_| {}).unwrap_err();
    assert!(
        e.to_string()
            .contains("token id 5000 is outside the model's vocabulary of 2048"),
        "{e}"
    );
    let opts = GenerateOptions {
        sampling: SamplingParams {
            temperature: -0.5,
            top_k: None,
            top_p: None,
        },
        ..greedy(4, true)
    };
    let e = generate(&lm, &[1], &opts, |_| {}).unwrap_err();
    assert!(e.to_string().contains("temperature"), "{e}");
}

/// A batch of prompts of different lengths, left-padded and decoded together (GRPO's and
/// PPO's rollouts), samples for each prompt what its group alone samples: padding is never
/// attended to and each row's positions count from its own first token. Greedy rows are
/// transformers' tokens whatever the padding.
#[test]
fn prompts_of_different_lengths_decoded_together_sample_each_groups_own_completions() {
    use tune::generation::{GroupPrompt, GroupSampling, sample_group, sample_groups};
    let m = model("tiny-llama");
    let full = reference().prompt;
    assert!(full.len() > 4, "the fixture's prompt is long enough to cut");
    let short = full[..full.len() - 3].to_vec();
    let other: Vec<u32> = full.iter().rev().copied().collect();
    let opts = GroupSampling {
        max_new_tokens: 10,
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: Some(50),
            top_p: Some(0.95),
        },
        stop_ids: vec![2004, 2001],
    };
    let seeds = [[5u64, 6, 7], [8, 9, 10], [11, 12, 13]];
    let prompts = [short.as_slice(), full.as_slice(), other.as_slice()];
    let batch: Vec<GroupPrompt<'_>> = prompts
        .iter()
        .zip(&seeds)
        .map(|(tokens, seeds)| GroupPrompt { tokens, seeds })
        .collect();
    let together = sample_groups(&m, &batch, &opts, &mut |done| done).unwrap();
    assert_eq!(together.len(), prompts.len());
    for (p, (prompt, seeds)) in prompts.iter().zip(&seeds).enumerate() {
        let alone = sample_group(&m, prompt, &opts, seeds, &mut |done| done).unwrap();
        assert_eq!(together[p], alone, "prompt {p}");
    }
    // Greedy: the fixture's prompt, left-padded beside a longer one, decodes transformers'
    // tokens.
    let longer: Vec<u32> = other.iter().chain(&full[..3]).copied().collect();
    let greedy = GroupSampling {
        max_new_tokens: reference().max_new_tokens,
        sampling: SamplingParams::GREEDY,
        stop_ids: vec![],
    };
    let batch = [
        GroupPrompt {
            tokens: &longer,
            seeds: &[0],
        },
        GroupPrompt {
            tokens: &full,
            seeds: &[0],
        },
    ];
    let groups = sample_groups(&m, &batch, &greedy, &mut |done| done).unwrap();
    assert_eq!(
        groups[1].completions[0],
        &reference().expected[full.len()..]
    );
}

/// GRPO's group sampling: each completion of a group (the prompt prefilled once, its cache
/// repeated, every row decoding in one batched pass) is the completion `generate` samples alone
/// from the same seed, stop token included; rows that stopped stay stopped while the others go
/// on; and `agree` ends decoding when it says so.
#[test]
fn a_sampled_group_is_each_seeds_own_generation() {
    use tune::generation::{GroupSampling, sample_group};
    let m = model("tiny-llama");
    let prompt = reference().prompt;
    let sampling = SamplingParams {
        temperature: 1.0,
        top_k: Some(50),
        top_p: Some(0.95),
    };
    let stop_ids = vec![2004, 2001];
    let opts = GroupSampling {
        max_new_tokens: 12,
        sampling,
        stop_ids: stop_ids.clone(),
    };
    let seeds = [3u64, 17, 17, 99, 2024];
    let group = sample_group(&m, &prompt, &opts, &seeds, &mut |done| done).unwrap();
    assert_eq!(group.completions.len(), seeds.len());
    for (row, &seed) in seeds.iter().enumerate() {
        let alone = generate(
            &m,
            &prompt,
            &GenerateOptions {
                max_new_tokens: 12,
                sampling,
                seed,
                stop_ids: stop_ids.clone(),
                stop_at_eos: true,
                use_kv_cache: true,
            },
            |_| {},
        )
        .unwrap();
        assert_eq!(
            group.completions[row], alone.tokens,
            "row {row} (seed {seed})"
        );
        assert_eq!(
            group.stopped[row],
            matches!(alone.stop, StopReason::StopToken(_)),
            "row {row}"
        );
    }
    // The same seed twice samples the same completion.
    assert_eq!(group.completions[1], group.completions[2]);
    // Greedy rows are transformers' greedy tokens.
    let greedy_opts = GroupSampling {
        max_new_tokens: reference().max_new_tokens,
        sampling: SamplingParams::GREEDY,
        stop_ids: vec![],
    };
    let g = sample_group(&m, &prompt, &greedy_opts, &[0, 1], &mut |done| done).unwrap();
    // The fixture's ids are the prompt's followed by the generated ones.
    let expected = &reference().expected[prompt.len()..];
    assert_eq!(g.completions[0], expected);
    assert_eq!(g.completions[1], expected);
    // `agree` stops the group after its first answer of true (here: at once).
    let mut calls = 0;
    let cut = sample_group(&m, &prompt, &opts, &seeds, &mut |_| {
        calls += 1;
        true
    })
    .unwrap();
    assert_eq!(calls, 1);
    assert!(cut.completions.iter().all(|c| c.len() == 1));
}
