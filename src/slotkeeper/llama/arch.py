"""llama.cpp b11434's architecture tables: which architectures are recurrent, hybrid, memoryless, use a window.

Why apart from modelinfo.py: these are data copied from llama.cpp, to be compared with its source and updated
when the llama.cpp build is; modelinfo.py is the code that classifies a model with them. Every table says
where in llama.cpp it comes from:

* the architecture lists are copied from ``src/llama-arch.cpp`` (``LLM_ARCH_NAMES``,
  ``llm_arch_is_recurrent``, ``llm_arch_is_hybrid``) and ``src/llama-model.cpp``
  (``llama_model::create_memory``: which architectures have no memory at all);
* which architectures use a sliding window, their default layer patterns and windows, come from each
  ``src/models/<arch>.cpp`` ``load_arch_hparams`` (``swa_type``, ``n_swa``, ``load_swa_pattern``).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Every architecture name of llama.cpp b11434 (src/llama-arch.cpp, LLM_ARCH_NAMES). An architecture outside
#: this set is classified from its keys.
# fmt: off
KNOWN_ARCHITECTURES = frozenset({
    "clip", "llama", "llama4", "deci", "falcon", "grok", "gpt2", "gptj", "gptneox", "mpt", "baichuan",
    "starcoder", "refact", "bert", "modern-bert", "nomic-bert", "nomic-bert-moe", "neo-bert", "jina-bert-v2",
    "jina-bert-v3", "eurobert", "bloom", "stablelm", "qwen", "qwen2", "qwen2moe", "qwen2vl", "qwen3", "qwen3moe",
    "qwen3next", "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe", "clef", "qwen4exp", "phi2", "phi3", "phimoe",
    "plamo", "plamo2", "plamo3", "codeshell", "orion", "internlm2", "minicpm", "minicpm3", "gemma", "gemma2",
    "gemma3", "gemma3n", "gemma4", "gemma4-assistant", "gemma-embedding", "starcoder2", "mamba", "mamba2",
    "maple", "jamba", "falcon-h1", "xverse", "command-r", "cohere2", "cohere2moe", "dbrx", "olmo", "olmo2",
    "olmoe", "muse-glimmer", "openelm", "arctic", "deepseek", "deepseek2", "deepseek2-ocr", "deepseek32",
    "deepseek4", "chatglm", "glm4", "glm4moe", "glm-dsa", "bitnet", "t5", "t5encoder", "jais", "jais2",
    "nemotron", "nemotron_h", "nemotron_h_moe", "exaone", "exaone4", "exaone-moe", "rwkv6", "rwkv6qwen2",
    "rwkv7", "arwkv7", "granite", "granitemoe", "granitehybrid", "graniteswitch", "granite_swa", "chameleon",
    "wavtokenizer-dec", "plm", "bailingmoe", "bailingmoe2", "bailingmoe3", "dots1", "dots3note", "arcee",
    "afmoe", "laguna", "ernie4_5", "ernie4_5-moe", "hunyuan-moe", "hunyuan-dense", "hunyuan_vl", "hy_v3",
    "hy_v4", "smollm3", "gpt-oss", "lfm2", "lfm2moe", "dream", "smallthinker", "llada", "llada-moe",
    "seed_oss", "grovemoe", "apertus", "minimax-01", "hrm_text", "minimax-m2", "minimax-m3", "cogvlm", "rnd1",
    "pangu-embedded", "mistral3", "eagle3", "dflash", "mistral4", "paddleocr", "mimo2", "step35", "spark2_5",
    "llama-embed", "maincoder", "kimi-linear", "kimi-k3", "glm5-next", "talkie", "mellum", "nanbeige",
    "qwen3tts", "pockettts",
})
# fmt: on

#: src/llama-arch.cpp, llm_arch_is_recurrent(): recurrent state only, no KV cache.
RECURRENT_ARCHITECTURES = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})

#: src/llama-arch.cpp, llm_arch_is_hybrid(): attention layers with a KV cache plus recurrent layers.
HYBRID_ARCHITECTURES = frozenset(
    {
        "jamba",
        "falcon-h1",
        "plamo2",
        "granitehybrid",
        "lfm2",
        "lfm2moe",
        "nemotron_h",
        "nemotron_h_moe",
        "qwen3next",
        "kimi-linear",
        "bailingmoe3",
        "kimi-k3",
        "glm5-next",
        "qwen35",
        "qwen35moe",
        "qwen4exp",
        "deepseek4",
        "minimax-01",
    }
)

#: src/llama-model.cpp, llama_model::create_memory(): architectures whose context has no memory at all
#: (encoders, embedding and diffusion models).
MEMORYLESS_ARCHITECTURES = frozenset(
    {
        "bert",
        "jina-bert-v2",
        "jina-bert-v3",
        "nomic-bert",
        "nomic-bert-moe",
        "neo-bert",
        "eurobert",
        "wavtokenizer-dec",
        "modern-bert",
        "gemma-embedding",
        "dream",
        "llada",
        "llada-moe",
        "rnd1",
        "clef",
    }
)

#: src/llama-model.cpp, llama_model::create_memory(): architectures with a cache of their own kind (an indexer
#: key cache for sparse attention, DeepSeek-V4's compressed cache, a shared draft cache). Their KV estimate
#: counts the attention K/V only and is marked inexact.
SPECIAL_CACHE_ARCHITECTURES = frozenset(
    {
        "minimax-m3",
        "glm-dsa",
        "deepseek32",
        "glm5-next",
        "hy_v4",
        "dots3note",
        "deepseek4",
        "qwen4exp",
        "dflash",
        "gemma4-assistant",
    }
)


@dataclass(frozen=True)
class SwaRule:
    """How an architecture's load_arch_hparams (src/models/<arch>.cpp) sets up its sliding window."""

    pattern: int | None  # load_swa_pattern's default n_pattern; None: the per-layer array is required
    dense_first: bool = False
    optional: bool = False  # SWA only when <arch>.attention.sliding_window is present and > 0
    default_window: int | None = None  # n_swa when the key is absent (None: the key is required)
    forced_window: int | None = None  # n_swa set after reading the key (the key only switches SWA on)
    chunked: bool = False  # LLAMA_SWA_TYPE_CHUNKED (llama4) rather than STANDARD


#: Architectures whose load_arch_hparams sets swa_type (src/models/*.cpp in b11434). Special cases handled in
#: code: exaone4 (SWA only for its 64-layer model), llama4 (chunked unless the window key is 0), lfm2 (the
#: window covers its attention layers), deepseek4 (every layer), phi3 (its SWA is disabled: full attention).
SWA_RULES: dict[str, SwaRule] = {
    "afmoe": SwaRule(4, optional=True),
    "cohere2": SwaRule(4),
    "cohere2moe": SwaRule(4, dense_first=True),
    "exaone-moe": SwaRule(4),
    "exaone4": SwaRule(4, default_window=4096),
    "gemma2": SwaRule(2, default_window=4096),
    "gemma3": SwaRule(6, optional=True),
    "gemma3n": SwaRule(5),
    "gemma4": SwaRule(None),
    "gemma4-assistant": SwaRule(None),
    "granite_swa": SwaRule(None),
    "laguna": SwaRule(4, dense_first=True, optional=True),
    "llama4": SwaRule(4, forced_window=8192, chunked=True),
    "maple": SwaRule(None),
    "mellum": SwaRule(4, optional=True),
    "mimo2": SwaRule(None),
    "muse-glimmer": SwaRule(4),
    "olmo2": SwaRule(4, optional=True),
    "gpt-oss": SwaRule(2),
    "plamo3": SwaRule(8, optional=True),
    "smallthinker": SwaRule(4, dense_first=True, optional=True, forced_window=4096),
    "spark2_5": SwaRule(None),
    "step35": SwaRule(None),
    "dots3note": SwaRule(None),
}

#: Hybrid architectures whose recurrent layers are listed in <arch>.attention.recurrent_layers or else follow
#: <arch>.full_attention_interval (this default): src/models/{qwen3next,qwen35,qwen35moe,qwen4exp,minimax-01}.cpp.
INTERVAL_HYBRIDS = {"qwen3next": 4, "qwen35": 4, "qwen35moe": 4, "qwen4exp": 4, "minimax-01": 8}

#: Key groups (``<arch>.ssm.*``, ...) that mean recurrent state, for an architecture these tables do not know.
RECURRENT_KEY_GROUPS = ("ssm.", "shortconv.", "wkv.", "kda.")

#: src/llama-hparams.h, LLAMA_MAX_LAYERS.
MAX_LAYERS = 512
