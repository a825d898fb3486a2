"""K2 Figure 2 in miniature: max attention logit per step, Muon with and without QK-Clip.

  python bench/logit_growth.py [--steps=150] [--lr=0.1] [--tau=20] [--out=logit_growth.png]

Trains the tiny preset twice from the same init on the same batches (bundled corpus via
k2jax.data, seq 64, batch 8) with Muon at an aggressive LR (0.1, no weight decay): once with QK-Clip (tau low, default
20) and once without (qk_clip_tau=None). Saves a PNG with the per-step max pre-softmax logit (max
over layers and heads, the value QK-Clip acts on) and both loss curves, and prints key=value figures.
A minimal loop on purpose: the real trainer is k2jax/train.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from k2jax.data import PretrainDataConfig, make_pretrain_iter
from k2jax.model import K2Model, presets
from k2jax.optim import QKClipSpec, muonclip, muonclip_metrics


def batches(n, seq_len, batch_size):
  it = make_pretrain_iter(PretrainDataConfig(seq_len=seq_len, batch_size=batch_size, seed=0))
  return [{k: jnp.asarray(v) for k, v in next(it).items() if k != "issue_counts"} for _ in range(n)]


def train(cfg, data, *, lr, tau, weight_decay):
  model = K2Model(cfg, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  opt = muonclip(lr, weight_decay=weight_decay, qk_clip_tau=tau, qk_clip_spec=QKClipSpec.from_config(cfg))
  opt_state = opt.init(params)

  def loss_fn(params, batch):
    out = nnx.merge(graphdef, params, rest)(batch["input_ids"], batch["segment_ids"], batch["positions"])
    nll_BT = optax.softmax_cross_entropy_with_integer_labels(out.logits, batch["targets"])
    mask_BT = batch["loss_mask"].astype(jnp.float32)
    return jnp.sum(nll_BT * mask_BT) / jnp.maximum(jnp.sum(mask_BT), 1.0), out.max_logits

  @jax.jit
  def step(params, opt_state, batch):
    (loss, max_logits_LH), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params, max_logits=max_logits_LH)
    clipped = muonclip_metrics(opt_state)["qk_clipped_heads"]
    return optax.apply_updates(params, updates), opt_state, loss, jnp.max(max_logits_LH), clipped

  losses, logits, clipped = [], [], []
  for batch in data:
    params, opt_state, loss, max_logit, n_clipped = step(params, opt_state, batch)
    losses.append(float(loss))
    logits.append(float(max_logit))
    clipped.append(int(n_clipped))
  return np.array(losses), np.array(logits), np.array(clipped)


def plot(path, runs, tau):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  for name, (loss, logit, _) in runs.items():
    ax1.plot(logit, label=name)
    ax2.plot(loss, label=name)
  ax1.axhline(tau, color="gray", ls="--", lw=0.8, label=f"tau={tau:g}")
  ax1.set(xlabel="step", ylabel="max attention logit", title="Max logit (all layers, heads)")
  ax2.set(xlabel="step", ylabel="train loss", title="Loss")
  ax1.legend()
  ax2.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=150)
  ap.add_argument("--lr", type=float, default=0.1)
  ap.add_argument("--tau", type=float, default=20.0)
  ap.add_argument("--weight_decay", type=float, default=0.0)
  ap.add_argument("--seq_len", type=int, default=64)
  ap.add_argument("--batch_size", type=int, default=8)
  ap.add_argument("--out", default="logit_growth.png")
  args = ap.parse_args()
  cfg = presets.get("tiny")
  data = batches(args.steps, args.seq_len, args.batch_size)
  runs = {}
  for name, tau in (("muon", None), ("muonclip", args.tau)):
    t0 = time.perf_counter()
    runs[name] = train(cfg, data, lr=args.lr, tau=tau, weight_decay=args.weight_decay)
    print(f"{name}_seconds={time.perf_counter() - t0:.1f}")
  plot(args.out, runs, args.tau)
  for name, (loss, logit, clipped) in runs.items():
    tail = max(1, len(loss) // 10)
    print(
      f"{name}_max_logit_peak={logit.max():.2f} {name}_max_logit_final={logit[-1]:.2f} "
      f"{name}_loss_final={loss[-tail:].mean():.4f} {name}_clipped_steps={(clipped > 0).sum()}"
    )
  print(f"peak_logit_ratio_muon_over_muonclip={runs['muon'][1].max() / runs['muonclip'][1].max():.2f}")
  print(f"final_loss_ratio_muonclip_over_muon={runs['muonclip'][0][-30:].mean() / runs['muon'][0][-30:].mean():.4f}")
  print(f"plot={args.out}")


if __name__ == "__main__":
  main()
