//! A tiny random model served over a `PagedKv` on Flex (the host backend): two requests
//! prefilled, the second sharing the first's prompt prefix, decode steps (eager, then captured
//! once and replayed), one request leaving, a corruption injected into the KV cache and reported
//! by the canary.
//!
//! `cargo test --release --workspace --example paged_kv -- --nocapture` (the workspace's features)

use burn_core::tensor::{DType, Device, Int, Tensor, TensorData};
use kvplan::{CanaryConfig, PagedKv, PagedKvConfig, RequestId, StepInputs};

/// One attention layer with random weights: embed, project to queries|keys|values, attend over
/// the paged cache, project to logits.
struct TinyModel {
    embed: Tensor<2>,
    qkv: Tensor<2>,
    head: Tensor<2>,
}

impl TinyModel {
    fn new(config: &PagedKvConfig, vocab: usize, device: &Device) -> Self {
        let hidden = 32;
        let uniform = |shape: [usize; 2], seed: u64| {
            let values = (0..shape[0] * shape[1])
                .map(|i| ((i as u64 * 2654435761 + seed) % 1000) as f32 / 1000.0 - 0.5)
                .collect::<Vec<_>>();
            Tensor::<2>::from_data(TensorData::new(values, shape), device)
        };
        Self {
            embed: uniform([vocab, hidden], 1),
            qkv: uniform([hidden, config.qkv_width()], 2),
            head: uniform([config.query_heads * config.head_dim, vocab], 3),
        }
    }

    /// Each request's next token after the step's new `tokens` (its window, laid out in order).
    fn forward(
        &self,
        kv: &mut PagedKv,
        windows: &[(RequestId, &[u32])],
    ) -> kvplan::Result<Vec<u32>> {
        let step = kv.begin(windows)?; // slots, table, contexts, key runs: one write, enqueued
        let next = tokens(self.next(kv, &step)?);
        let mut at = 0;
        Ok(windows
            .iter()
            .map(|(_, t)| {
                at += t.len();
                next[at - 1]
            })
            .collect())
    }

    /// The step's core (README): embed, project, attend over the paged cache (this layer's K/V
    /// stored, its queries attended), project to logits; each token's greedy next token.
    fn next(&self, kv: &mut PagedKv, step: &StepInputs) -> kvplan::Result<Tensor<2, Int>> {
        let hidden = self.embed.clone().select(0, step.ids.clone());
        let qkv = hidden.matmul(self.qkv.clone()); // a real model applies RoPE at step.positions
        let attended = kv.attend(0, qkv)?;
        Ok(attended.matmul(self.head.clone()).argmax(1))
    }
}

fn tokens(next: Tensor<2, Int>) -> Vec<u32> {
    kvplan::backend::data_to_i64(&next.into_data())
        .into_iter()
        .map(|t| t as u32)
        .collect()
}

fn main() -> kvplan::Result<()> {
    let device = Device::flex();
    let config = PagedKvConfig {
        layers: 1,
        query_heads: 4,
        kv_heads: 2,
        head_dim: 8,
        slots: 64,
        max_requests: 4,
        max_context: 32,
        dtype: DType::F32,
        canary: Some(CanaryConfig::default()),
    };
    let model = TinyModel::new(&config, 50, &device);
    let mut kv = PagedKv::new(config.clone(), &device)?;

    // Prefill A; B starts from A's first 4 tokens (a shared system prompt, stored once).
    let a = kv.add()?;
    let prompt_a = [1, 2, 3, 4, 5, 6];
    let mut next = model.forward(&mut kv, &[(a, &prompt_a)])?;
    kv.end(&[prompt_a.len()])?;
    let b = kv.share(a, 4)?;
    let prompt_b = [9, 10];
    next.extend(model.forward(&mut kv, &[(b, &prompt_b)])?);
    kv.end(&[prompt_b.len()])?;
    println!(
        "prefilled: A {} tokens, B {} (4 shared)",
        kv.len(a)?,
        kv.len(b)?
    );

    // Decode both, one token a step: the first step eagerly (its kernels compiled), then captured
    // once and replayed (one dispatch a step on CUDA and wgpu; Flex runs the step again).
    next = model.forward(&mut kv, &[(a, &[next[0]]), (b, &[next[1]])])?;
    let report = kv.end(&[1, 1])?; // each keeps its one token
    assert!(report.violations.is_empty());
    let (mut graph, report) = kv.capture(&[(a, &[next[0]]), (b, &[next[1]])], |kv, step| {
        model.next(kv, step)
    })?;
    assert!(report.violations.is_empty());
    next = tokens(graph.output().expect("captured").clone()?);
    for _ in 0..2 {
        let (out, report) = kv.replay(&mut graph, &[(a, &[next[0]]), (b, &[next[1]])])?;
        assert!(report.violations.is_empty());
        next = tokens(out.clone()?);
    }
    drop(graph);
    println!("decoded: A {} tokens, B {}", kv.len(a)?, kv.len(b)?);

    // A leaves: B keeps the shared slots.
    kv.remove(a)?;
    println!("A left: {} of {} slots free", kv.free_slots(), config.slots);

    // A flipped bit in B's cached K at position 2 (a shared slot): the next step reports it.
    let slot = kv.slots(b)?[2] as usize;
    let width = config.kv_width();
    let mut pool = kv
        .pool(0)?
        .into_data()
        .try_to_vec::<f32>()
        .expect("f32 pool");
    pool[slot * width] = f32::from_bits(pool[slot * width].to_bits() ^ 0x2000_0000);
    kv.set_pool(
        0,
        Tensor::from_data(TensorData::new(pool, [config.slots + 1, width]), &device),
    )?;
    let tb = [next[1]];
    model.forward(&mut kv, &[(b, &tb)])?;
    let report = kv.end(&[1])?;
    for v in &report.violations {
        println!(
            "canary: request {} position {} slot {}: {:?}",
            v.request, v.position, v.slot, v.reasons
        );
    }
    assert_eq!(
        report.violations.len(),
        1,
        "the corruption is reported once"
    );
    assert_eq!(
        (report.violations[0].request, report.violations[0].position),
        (b, 2)
    );

    // B recomputes its cache (drop it, prefill again), then leaves: every slot is free.
    kv.truncate(b, 0)?;
    kv.remove(b)?;
    assert_eq!(
        (kv.free_slots(), kv.free_rows()),
        (config.slots, config.max_requests)
    );
    println!("done: every slot and row free");
    Ok(())
}

// CI runs the example through `cargo test` (Cargo.toml: `test = true`).
#[test]
fn example_runs() {
    main().expect("the example runs to its end");
}
