"""Parameter groups for MuonClip: one label function over parameter paths.

The label of a leaf decides which optimizer branch updates it (K2 §2.1, ML §2.2):

  'adamw'        embed.*, lm_head.* and every *.scale (RMSNorm gains; stacked [L, D], so ndim alone
                 cannot tell them from matrices, hence the path rule)
  'muon'         every other matrix: the last two axes [in, out] are the matrix, leading axes (the
                 stacked layer axis) are batch axes; one orthogonalisation per layer
  'muon_expert'  routed-expert matrices [L, E, D, F]: one orthogonalisation per expert matrix where
                 it lives (the expert axis keeps its sharding; see muon.py)

Works on any pytree keyed by the model's path names: nested dicts of arrays or `nnx.State` (whose
leaves flatten through `Variable.value`). Non-Param variables (the MoE balancing bias) must not be in
the tree: the trainer passes `nnx.state(model, nnx.Param)`; `label_params` rejects a `router.bias`.
"""

import math

import jax

ADAMW = "adamw"
MUON = "muon"
MUON_EXPERT = "muon_expert"
LABELS = (ADAMW, MUON, MUON_EXPERT)

_ADAMW_PREFIXES = ("embed.", "lm_head.")


def path_name(path) -> str:
  """Dotted name of a key path, e.g. 'moe_layers.attn.w_q_b' (an nnx `.value` suffix is dropped)."""
  parts = []
  for key in path:
    if isinstance(key, jax.tree_util.DictKey):
      parts.append(str(key.key))
    elif isinstance(key, jax.tree_util.GetAttrKey):
      parts.append(key.name)
    elif isinstance(key, jax.tree_util.SequenceKey):
      parts.append(str(key.idx))
    else:
      parts.append(str(key))
  if len(path) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey) and parts[-1] == "value":
    parts.pop()
  return ".".join(parts)


def label_for(name: str, shape) -> str:
  """Label of one parameter from its dotted path name and shape; raises on what must not be here."""
  if name.endswith("router.bias"):
    raise ValueError(
      f"{name}: the MoE balancing bias is not a trained parameter and must not be in the "
      "optimizer tree (pass nnx.state(model, nnx.Param))"
    )
  if name.startswith(_ADAMW_PREFIXES) or name.endswith(".scale") or name == "scale":
    return ADAMW
  if len(shape) < 2:
    raise ValueError(
      f"{name}: shape {tuple(shape)} has no matrix axes; Muon needs >= 2 dims and "
      "only embed.*, lm_head.* and *.scale go to AdamW"
    )
  if ".experts." in f".{name}":
    return MUON_EXPERT
  return MUON


def label_params(params):
  """Tree of labels ('adamw' | 'muon' | 'muon_expert') with the structure of `params`."""
  return jax.tree_util.tree_map_with_path(lambda p, x: label_for(path_name(p), x.shape), params)


def describe_param_groups(params) -> str:
  """Human-readable table: path, shape, group, matrix shape [A, B], matrices count, Muon scale."""
  rows = [("path", "shape", "group", "matrix", "n_mat", "muon_scale@0.2")]
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = path_name(path)
    label = label_for(name, x.shape)
    if label == ADAMW:
      rows.append((name, str(tuple(x.shape)), label, "-", "-", "-"))
      continue
    a, b = x.shape[-2:]
    rows.append(
      (name, str(tuple(x.shape)), label, f"{a}x{b}", str(math.prod(x.shape[:-2])), f"{0.2 * math.sqrt(max(a, b)):.2f}")
    )
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
