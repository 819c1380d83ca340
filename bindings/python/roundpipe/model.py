"""RoundPipe: upstream's model API over libroundpipe.

The top of the three layers (``_capi`` raw declarations -> ``_internals`` handle owners -> this
module), as llama-cpp-python's ``llama.py``: the user's names and defaults, no C handle of its
own. What the engine decides (default run configuration, split rule, default merge, stage plan,
Hugging Face names) is asked of it through ``_internals``; what only Python can see (call
structure, split specs, custom merges) lives in ``_microbatch`` and ``config``.
"""

import json
import logging
from ctypes import c_int64
from typing import Any, Callable, List, Optional, Sequence, Union

import torch
from torch import nn

from ._args import (LOSSES, BuiltinLoss, HostStateBytes, builtin_loss, call_site_name,
                    parse_devices, parse_dtype, parse_grad_scaler, parse_host_memory,
                    parse_pin_model)
from ._callbacks import StepCall, registry
from ._capi import kDLCPU
from ._dlpack import BorrowedInputs
from ._forward_autograd import PendingBackward, connect, inputs_wanting_grad
from ._internals import CallScope, Loss, Model, ModelOptions, Params, RunConfig
from ._call_hooks import forward_backward_call, forward_call
from ._microbatch import (RoundPipePackedData, builtin_label_dim, call_inputs, merge_outputs,
                          pack_leaves, split_label)
from .execute_plan import EnginePlan, check_model_plan, model_stage_plan
from .config import _GRAINS, RoundPipeRunConfig
from .convert import resolve_model
from .distributed import parse_data_parallel
from .errors import RoundPipeError, RoundPipeUnsupportedError, Status
from .causal_lm import CausalLM, causal_lm_forward, causal_lm_forward_backward
from .hf import hf_inputs, module_weights
from .lora import LoraConfig, lora_config, lora_of_engine, peft_state_name
from ._device_loss import python_loss
from ._module_sync import copy_into_module
from ._tree_call import layer_call, tree_inputs, tree_outputs
from .optim import BuiltinOptimizer
from .grad_scaler import StepTracker
from ._weights import WeightsMixin

logger = logging.getLogger("roundpipe")

__all__ = ["RoundPipe", "BuiltinLoss", "HostStateBytes", "RoundPipePackedData", "spec_json"]

_GRAIN_NAMES = {value: name for name, value in _GRAINS.items()}


class RoundPipe(WeightsMixin):
    """A model trained by the RoundPipe engine.

    Args:
        model: what to run: a JSON layer spec (dict, list of layer dicts, JSON text or path of a
            .json file; see docs/semantics.md); any ``nn.Module``: an ``nn.Sequential``'s
            children are the layers, any other module is one layer; modules the engine
            implements run natively, every other one as a Python layer (functional_call over
            the parameters the engine lends, torch autograd), passing any pytree on; a transformers ``Qwen3ForCausalLM`` / ``LlamaForCausalLM``
            (built from its config, weights copied), or a PEFT LoRA model of one
            (``get_peft_model``: the engine holds its adapters, see `lora`); a Hugging Face
            model directory
            (config.json and safetensors weights; config.json alone gives random weights); or a
            Hugging Face config (dict or JSON text with "architectures", or a transformers
            config object; random weights). Causal LMs take input_ids, attention_mask and
            position_ids, return logits and train with ``loss_fn="causal_lm"``.
        optim_dtype: dtype of master weights and optimizer state (torch.float32 (default),
            torch.bfloat16 or torch.float16).
        name: shown in logs; default "file.py:line" of the caller.
        model_run_config: model-level RoundPipeRunConfig.
        pin_model: "alloc" (default), "register" or "off": how host weights are pinned.
        model_dtype: dtype the devices compute with (default: the module's parameter dtype;
            for a Hugging Face directory or config its "dtype" entry, as transformers'
            from_pretrained reads it; else float32).
        devices: which workers run the stages: "auto" (default: every GPU, else one CPU
            worker), "cpu", "cuda", an int count, or (kind, count) such as ("cpu", 2) for two
            CPU worker devices.
        seed: seed of weight initialisation and dropout (default 0).
        stage_plan: explicit list of layers per stage (default: automatic); the plan in
            force is :meth:`stage_plan`.
        gpu_memory_cap: bytes of GPU memory the model may use per GPU (default: 80% of free).
        grad_scaler: dynamic loss scaling as ``(initial_scale, growth_interval)``, ``False`` to
            turn it off (default: on for float16 models, off otherwise).
        host_memory: host memory layout of the per-parameter state (``rp_host_memory_mode``):
            ``"standard"`` (default): 24 bytes per parameter for bf16 / fp16 models, 28 for
            fp32 ones (fp32 master, fp32 AdamW moments, two fp32 gradient buffers, two
            model-dtype weight copies), so an asynchronous step overlaps the whole next call
            and its weights are one step stale. ``"saving"``: 12 bytes per parameter (fp32
            master, built-in AdamW moments / SGD momentum in bf16 with stochastic rounding, one
            gradient buffer: bf16, fp32 for fp32 models, and one model-dtype weight copy, none
            for fp32 models); steps still overlap the next call, layer by layer, and weights
            are never stale. The memory saving is the built-in optimizers'
            (``step(roundpipe.optim.AdamW(...))``): a Python ``step_fn`` with a torch.optim
            optimizer sees fp32 copies of bf16 gradients (torch.optim needs gradients of the
            parameters' dtype), made for the step, and keeps its own fp32 state.
            :meth:`host_state_bytes` reports what the model holds. Any other value raises
            ValueError before anything is built.
        skip_nonfinite_steps: skip a step whose gradients hold inf or nan (default True; the
            weights and optimizer state stay, a warning is logged, :meth:`nonfinite_counts`
            counts it); with a grad scaler on, the scaler's rule decides.
        data_parallel: data parallelism across processes (docs/several-machines.md): a
            :class:`roundpipe.DataParallel` (``True``: ``DataParallel()``, torchrun's
            environment; None (default) or ``False``: one process). Creating the model joins
            the group (blocks until every rank has); before the first training call every rank
            takes rank 0's weights (also those copied in from an ``nn.Module``); the gradients
            are averaged over the ranks before each step. :attr:`rank` and :attr:`world_size`
            are the engine's answers.
        lora: LoRA adapters on the decoder layers of a Hugging Face Qwen3 / Llama model
            (docs/lora.md): a :class:`roundpipe.LoraConfig`, a dict of its fields (``r``,
            ``lora_alpha``, ``lora_dropout``, ``target_modules``) or a ``peft.LoraConfig``
            (RoundPipeUnsupportedError names a field the engine cannot follow: DoRA, rsLoRA,
            rank / alpha patterns, some layers only, modules_to_save, a bias, a regular
            expression as target_modules, an initialisation other than PEFT's default). Every
            other parameter becomes frozen, held once in the model dtype. The adapters start as
            PEFT initialises them (B zero); those of a PEFT model given as `model` are copied
            from it (its own LoraConfig describes them: `lora` must then be None), and
            :meth:`synchronize` writes the trained ones back into it. :attr:`lora` is the
            engine's answer; :meth:`save_lora` / :meth:`load_lora` move adapters in PEFT's
            format, :meth:`save_merged` writes the merged model. Other models refuse it.
    """

    def __init__(self, model, optim_dtype=None, name=None, model_run_config=None,
                 pin_model="alloc", *, model_dtype=None, devices=None, seed=None,
                 stage_plan=None, gpu_memory_cap=None, grad_scaler=None,
                 host_memory="standard", skip_nonfinite_steps=True, data_parallel=None,
                 lora=None):
        self._model = None  # first: close() must work if __init__ fails
        if name is None:
            name = call_site_name()
        if model_run_config is None:
            model_run_config = RoundPipeRunConfig()
        if not isinstance(model_run_config, RoundPipeRunConfig):
            raise TypeError("model_run_config must be a RoundPipeRunConfig")
        pin_mode = parse_pin_model(pin_model)
        host_memory_mode = parse_host_memory(host_memory)
        data_parallel = parse_data_parallel(data_parallel)
        source = resolve_model(model)
        if source.peft is not None:
            if lora is not None:
                raise RoundPipeUnsupportedError("lora=: the adapters of a PEFT model are those "
                                                "its own LoraConfig made; leave lora=None")
            lora = source.peft.config
        lora = lora_config(lora)
        options = dict(
            model_dtype=parse_dtype(model_dtype if model_dtype is not None else source.dtype,
                                    "model_dtype"),
            optim_dtype=parse_dtype(optim_dtype, "optim_dtype"), pin_mode=pin_mode,
            host_memory_mode=host_memory_mode, seed=seed, name=str(name),
            devices=parse_devices(devices), gpu_memory_cap=gpu_memory_cap,
            grad_scaler=parse_grad_scaler(grad_scaler),
            skip_nonfinite_steps=bool(skip_nonfinite_steps),
            data_parallel=data_parallel.engine_values() if data_parallel else None,
            lora=lora.engine_values() if lora is not None else None)
        # The model's own plans (None: the planner's), restored after a call with a plan of its
        # own (execute_plan.check_call_plan).
        self._model_plan = model_stage_plan(stage_plan, model_run_config.execute_plan)
        options["stage_plan"] = self._model_plan.forward if self._model_plan else None
        self._plan_overridden = False
        # The engine gets the model-level fields it holds and overlays each call's on them; the
        # Python-only ones (split specs, custom merges) are overlaid by call_fields() per call.
        self._python_layers = source.converted.python_layers if source.converted else []
        try:
            with RunConfig.build(**model_run_config.engine_fields()) as run_config, \
                    ModelOptions(run_config=run_config, **options) as c_options:
                # The engine copies each declaration: they live only while it builds.
                shared = {}  # tied weights across Python layers: one engine parameter
                source.layer_defs = [layer.declare(shared) for layer in self._python_layers]
                self._model = Model(source, c_options)
                if self._model_plan and self._model_plan.backward:
                    self._model.set_backward_stage_plan(self._model_plan.backward)
        except BaseException:
            self._unregister_layers()
            raise
        finally:
            for layer_def in source.layer_defs:
                layer_def.close()
        self._runtime = source.converted.runtime if source.converted else None
        self._name = str(name)
        self._run_config = model_run_config
        self._host_memory = host_memory
        self._params = Params(self._model.handle.value)
        # Python step_fn / loss_fn bookkeeping for GradScaler and OptimizerCtx (grad_scaler.py)
        self._steps = StepTracker(self._model.grad_scale()[0] > 0, str(name),
                                  self._sync_engine)
        # The wrapped module's mode: a module put in eval() before wrapping gives inference forwards.
        self.training = bool(getattr(model, "training", True))
        self.model = model if isinstance(model, nn.Module) else None
        self._original_model = self.model
        self._hf_config = source.config if source.is_hf else None
        self._peft = source.peft  # the PEFT model's adapter layout, when built from one
        self._hf_dir = source.path if source.kind == "hf_dir" else None
        # Hugging Face causal LMs return transformers' output objects (roundpipe.causal_lm)
        self._causal_lm = CausalLM(self.model, native=True, config=self._hf_config) \
            if self._hf_config is not None else None
        self._module_names = None
        try:
            check_model_plan(self)
            self._copy_module_weights(source)
        except BaseException:
            self.close()
            raise
        # The module's frozen tensors are the engine's (it was the source); only loads and the
        # data-parallel broadcast change them, so synchronize() copies them only after those.
        self._module_frozen_stale = False

    def _copy_module_weights(self, source):
        """Copy the weights of the module the model was built from, by engine name (an
        nn.Sequential's, by the converter's names; a transformers model's, by the Hugging Face
        names the engine gives its parameters)."""
        if source.converted is not None:
            weights = source.converted.params
            self._module_names = source.converted.module_names()
            if weights:  # Python layers' values were copied when they were declared
                self._copy_in([(engine_name, p) for engine_name, p, _ in weights])
            return
        elif source.module is not None:
            params, state_name = self._hf_params(), None
            if source.peft is not None:  # its adapters too, under PEFT's names
                state_name = peft_state_name([hf_name for _, hf_name, _ in params], source.peft)
            elif self.lora is not None:  # a plain model: the adapters keep the engine's init
                adapters = {name for name, p in self._params.build() if p.requires_grad}
                params = [entry for entry in params if entry[0] not in adapters]
            weights = module_weights(source.module, params,
                                     bool(self._hf_config.get("tie_word_embeddings")),
                                     state_name)
        else:
            return
        self._copy_in([(engine_name, p) for engine_name, p, _ in weights])
        self._module_names = {engine_name: mod_name for engine_name, _, mod_name in weights}

    # -- lifetime -----------------------------------------------------------------------------

    @property
    def handle(self):
        """The ``rp_model *`` (ctypes); RoundPipeError once closed."""
        if self._model is None:
            raise RoundPipeError(Status.STATE, "this RoundPipe model was closed")
        return self._model.handle

    def close(self):
        """Destroy the engine model (waits for work in flight). Idempotent. Parameters taken
        before stay valid tensors."""
        if self._model is not None:
            self._model.close()
        self._unregister_layers()

    def _unregister_layers(self):
        for layer in self.__dict__.get("_python_layers", ()):
            layer.unregister()

    @property
    def closed(self):
        return self._model is None or self._model.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        if self.closed:
            return "<RoundPipe %r (closed)>" % self.__dict__.get("_name", "?")
        return "<RoundPipe %r: %d layers, %d stages, %d devices>" % (
            self._name, self.num_layers, self.num_stages, self.num_devices)

    def __getattr__(self, name):
        # Upstream forwards unknown attributes to the original model (e.g. `config`).
        if name.startswith("_"):
            raise AttributeError(name)
        target = self.__dict__.get("_original_model")
        if target is None:
            raise AttributeError("'RoundPipe' object has no attribute %r" % name)
        return getattr(target, name)

    def _forwards(self, name):
        """Whether setting / deleting attribute `name` goes to the original model: names that
        RoundPipe itself has (its own attributes, methods, properties, private names) stay."""
        return (not name.startswith("_") and name not in self.__dict__
                and not hasattr(type(self), name)
                and self.__dict__.get("_original_model") is not None)

    def __setattr__(self, name, value):
        if self._forwards(name):
            setattr(self.__dict__["_original_model"], name, value)
        else:
            object.__setattr__(self, name, value)

    def __delattr__(self, name):
        if self._forwards(name):
            delattr(self.__dict__["_original_model"], name)
        else:
            object.__delattr__(self, name)

    def set_original_model(self, original_model):
        """Attributes RoundPipe does not have are read from, written to and deleted on
        `original_model` (wrap_model_to_roundpipe sets it, so that e.g. ``model.config`` of a
        wrapped transformers model works)."""
        self._original_model = original_model

    # -- facts (the engine's answers) ---------------------------------------------------------

    @property
    def name(self):
        return self._name

    @property
    def num_layers(self):
        return self._model.count("num_layers")

    @property
    def num_stages(self):
        return self._model.count("num_stages")

    @property
    def num_devices(self):
        return self._model.count("num_devices")

    @property
    def rank(self) -> int:
        """This process's data-parallel rank (0 without data parallelism), as the engine
        joined (``rp_model_data_parallel``)."""
        return self._model.data_parallel()[0]

    @property
    def world_size(self) -> int:
        """The number of data-parallel processes (1 without data parallelism)."""
        return self._model.data_parallel()[1]

    @property
    def lora(self) -> Optional[LoraConfig]:
        """The model's LoRA adapters as the engine reports them (``rp_model_lora``): a
        :class:`roundpipe.LoraConfig` whose target_modules lists the adapted projections in
        layer order, or None for a model without adapters."""
        return lora_of_engine(*self._model.lora())

    @property
    def step_count(self):
        """Optimizer steps enqueued so far."""
        return self._model.count("step_count", c_int64)

    @property
    def step_in_call(self) -> bool:
        """Whether each forward_backward is also the optimizer step (:meth:`set_step_in_call`;
        ``rp_model_step_in_call``)."""
        return self._model.step_in_call()

    @property
    def grad_scale(self):
        """``(scale, skipped_steps)`` of dynamic loss scaling (scale 0: off)."""
        return self._model.grad_scale()

    def nonfinite_counts(self):
        """``(nonfinite_losses, skipped_steps)``: training calls whose loss was inf or nan,
        and steps skipped because their gradients held inf or nan (``skip_nonfinite_steps``,
        on by default, or the loss scaler)."""
        return self._model.nonfinite_counts()

    @property
    def gpu_memory_cap(self):
        """GPU memory cap in bytes (0 on CPU devices)."""
        return self._model.count("gpu_memory_cap", c_int64)

    @property
    def host_memory(self):
        """The host memory mode the model was built with: "standard" or "saving"."""
        return self._host_memory

    def host_state_bytes(self):
        """Host memory held by the model's parameter state (``rp_model_host_state_bytes``), as
        a :class:`HostStateBytes` ``(bytes, elements, bytes_per_param)``: master weights,
        weight copies the devices read, gradient buffers and built-in optimizer state (which
        exists from the first built-in step on), counted as tensor bytes without allocator
        padding, over the number of parameter elements (tied parameters once). After a
        built-in AdamW step a bf16 model holds 24 bytes per parameter in standard mode and 12
        in saving mode (28 and 12 for fp32 models). State of a Python optimizer and the
        binding's gradient copies are not counted."""
        n_bytes, n_elements = self._model.host_state_bytes()
        return HostStateBytes(n_bytes, n_elements,
                              n_bytes / n_elements if n_elements else 0.0)

    def trace(self):
        """Timing record of the last call, as a Chrome trace dict (``rp_model_trace_json``)."""
        return json.loads(self._model.trace_json())

    def stage_plan(self):
        """The current stage plan (``rp_model_stage_plan``): the number of layers of each stage,
        in pipeline order (after the re-plan the third GPU training call makes from measured
        times)."""
        return self._model.stage_plan()

    def set_stage_plan(self, layers_per_stage: Optional[Sequence[int]]) -> None:
        """Replace the model's stage plan (``rp_model_set_stage_plan``): stage s holds the next
        ``layers_per_stage[s]`` layers; None returns to the automatic planner. It becomes the
        model's own plan (what calls without a per-call ``execute_plan`` run); a backward stage
        plan set before is dropped."""
        counts = [] if layers_per_stage is None else [int(c) for c in layers_per_stage]
        self._model.set_stage_plan(counts)
        self._model_plan = EnginePlan(counts) if counts else None
        self._plan_overridden = False

    def backward_stage_plan(self) -> List[int]:
        """The backward stages in force (``rp_model_backward_stage_plan``): layers per stage
        from layer 0, as :meth:`stage_plan`; the forward stages unless
        :meth:`set_backward_stage_plan` (or an asymmetric ``execute_plan``) set others."""
        return self._model.backward_stage_plan()

    def set_backward_stage_plan(self, layers_per_stage: Optional[Sequence[int]]) -> None:
        """Backward stages that differ from the forward ones
        (``rp_model_set_backward_stage_plan``): backward stage b holds the next
        ``layers_per_stage[b]`` layers from layer 0; None: the forward stages again. Needs an
        explicit stage plan (:meth:`set_stage_plan`); ``forward_backward()`` needs both plans
        to end with the same stage (the tail). It becomes part of the model's own plan."""
        counts = [] if layers_per_stage is None else [int(c) for c in layers_per_stage]
        self._use_call_plan(None)  # the backward plan follows the model's own forward plan
        self._model.set_backward_stage_plan(counts)
        if self._model_plan is not None:
            self._model_plan = EnginePlan(self._model_plan.forward, counts or None)

    def _use_call_plan(self, plans: Optional[EnginePlan]) -> None:
        """Run the next call on `plans` (a per-call execute_plan), or on the model's own plans
        again (None) after a call that had one."""
        if plans is None:
            if self._plan_overridden:
                self._install_plans(self._model_plan)
                self._plan_overridden = False
            return
        if plans.forward != self._model.stage_plan() or \
                (plans.backward or plans.forward) != self._model.backward_stage_plan():
            self._install_plans(plans)
            self._plan_overridden = True

    def _install_plans(self, plans: Optional[EnginePlan]) -> None:
        """Hand the engine both plans (None: its automatic planner). A new forward plan drops
        the engine's backward plan, so the backward one goes second."""
        self._model.set_stage_plan(plans.forward if plans else [])
        if plans and plans.backward:
            self._model.set_backward_stage_plan(plans.backward)

    @property
    def model_run_config(self):
        return self._run_config

    def resolved_run_config(self, run_config=None):
        """The configuration a call given `run_config` runs with: the engine's overlay of its
        fields on the model-level ones with the engine's defaults filled in
        (``rp_model_resolve_run_config``: num_microbatch, recompute_grain, output_device,
        merge_output), and the Python-side fields (split specs, custom merges) overlaid the
        same way."""
        py = self._run_config.call_fields(run_config)
        with self._call_config(run_config, py) as call, \
                self._model.resolve_run_config(call) as resolved:
            kind, index = resolved.output_device
            merge = resolved.merge_output == 1
            return RoundPipeRunConfig(
                num_microbatch=resolved.num_microbatch,
                recompute_grain=_GRAIN_NAMES[resolved.recompute_grain],
                output_device=torch.device("cpu") if kind == kDLCPU else
                torch.device("cuda", index),
                split_input=py.split_input, split_label=py.split_label,
                merge_output=py.merge_output if py.merge_output is not None else merge)

    def train(self, mode=True):
        """Training mode (the default, or the wrapped module's mode): forward() with gradients
        enabled is back-propagatable and runs dropout; eval(): forward() is inference.
        forward_backward() always runs in training mode."""
        self.training = bool(mode)
        return self

    def eval(self):
        return self.train(False)

    # -- calls --------------------------------------------------------------------------------

    @staticmethod
    def _call_config(run_config, py, input_dims=None, label_dim=None, split_callback=None,
                     per_microbatch=False):
        """The C configuration of one call: the engine fields `run_config` itself sets (the
        engine overlays them on the model's), merge 0 under a custom merge (`py`, from
        call_fields(): the binding merges the per-microbatch outputs) or when the outputs are
        pytrees (`per_microbatch`), and the split rules."""
        fields = run_config.engine_fields() if run_config is not None else {}
        if py.merge_output is not None or per_microbatch:
            fields["merge_output"] = 0
        return RunConfig.build(input_dims=input_dims, label_dim=label_dim,
                               split_callback=split_callback, **fields)

    def _configs(self, scope, run_config, py, dims, label_dim, split):
        """(C configuration of the call, resolved configuration, whether to merge)."""
        config = scope.own(self._call_config(run_config, py, dims, label_dim, split))
        resolved = scope.own(self._model.resolve_run_config(config))
        merge = resolved.merge_output == 1
        if self._tree_outputs:  # pytree outputs: the binding merges what the engine cannot
            config = scope.own(self._call_config(run_config, py, dims, label_dim, split, True))
        return config, resolved, merge

    @property
    def _tree_outputs(self):
        """The last layer is a Python layer: outputs are pytrees, rebuilt by the binding."""
        layers = self._python_layers
        return bool(layers) and layers[-1].index == self._model.count("num_layers") - 1

    def _call_inputs(self, args, kwargs, py):
        """(tensors, split dims, split call, Spec of the inputs or None)."""
        if self._python_layers and self._python_layers[0].first:
            return tree_inputs(args, kwargs, py.split_input)
        if self._hf_config is not None:  # input_ids, attention_mask, position_ids, in order
            args, kwargs = hf_inputs(args, kwargs)
        return call_inputs(args, kwargs, py.split_input) + (None,)

    def _outputs(self, tensors, py, resolved, merge, state):
        if self._tree_outputs:
            out = tree_outputs(tensors, state, self._python_layers[-1].index,
                               resolved.num_microbatch, py.merge_output, merge)
            return pack_leaves(out) if type(out) is RoundPipePackedData else out
        return merge_outputs(tensors, py.merge_output, merge)


    @causal_lm_forward
    @forward_call
    def forward(self, *args, roundpipe_run_config=None, **kwargs):
        """Split the inputs into microbatches, run them through the pipeline on the published
        weights, merge the outputs. In training mode (``train()``, the default) with gradients
        enabled, the outputs are connected to autograd: ``loss.backward()`` on them runs the
        pipeline's backward and accumulates the gradients the next ``step()`` uses (upstream's
        non-fused training; ``forward_backward()`` is faster). Otherwise (``eval()`` or
        ``torch.no_grad()``) it is inference: no gradients, dropout off. A run config's
        ``requires_grad`` (upstream's switch), when set, stands in for ``torch.is_grad_enabled()``
        here: True trains under ``torch.no_grad()`` too, False makes it inference."""
        model = self._model
        model.handle  # raises when closed
        py = self._run_config.call_fields(roundpipe_run_config)
        tensors, dims, split_call, tree = self._call_inputs(args, kwargs, py)
        # RoundPipeRunConfig.requires_grad, upstream's switch: unset follows torch's mode.
        grad = torch.is_grad_enabled() if py.requires_grad is None else bool(py.requires_grad)
        wanted = inputs_wanting_grad(tensors) if grad else []
        train = self.training and grad and (self._has_trainable_parameters() or bool(wanted))
        with CallScope() as scope, layer_call(self._runtime, self._python_layers, scope, tree,
                                              training=train) as state:
            split = scope.split_callback(split_call)
            config, resolved, merge = self._configs(scope, roundpipe_run_config, py, dims,
                                                    None, split)
            if not train:
                outputs = scope.run(model.forward, BorrowedInputs(tensors), config)
                return self._outputs(outputs.to_torch(), py, resolved, merge, state)
            outputs = scope.run(model.forward_train, BorrowedInputs(tensors), config)
            pending = PendingBackward(self._engine_backward(state), wants_inputs=bool(wanted))
            with torch.enable_grad():  # requires_grad=True records the graph under no_grad too
                connected = connect(outputs.to_torch(), pending, [tensors[i] for i in wanted],
                                    wanted)
            return self._outputs(connected, py, resolved, merge,
                                 state)

    def _has_trainable_parameters(self):
        return any(p.requires_grad for p in self.parameters())

    def _engine_backward(self, state):
        """rp_backward for a training forward whose Python-layer call state is `state`."""
        def run(grads, wants_inputs=False):
            with CallScope() as scope, layer_call(self._runtime, self._python_layers, scope,
                                                  None, True, state=state):
                if wants_inputs:
                    return scope.run(self._model.backward_input_grads, grads)
                scope.run(self._model.backward, grads)
                return None
        return run

    __call__ = forward

    @causal_lm_forward_backward
    @forward_backward_call
    def forward_backward(self, input_args=(), input_kwargs=None, label=None, loss_fn=None,
                         return_outputs=False, run_config=None):
        """Training: forward, loss and backward of every microbatch in one pipelined pass.

        Gradients are added to the accumulated gradients (consumed by the next step()); with
        :meth:`set_step_in_call` on, the call is the step itself. Inputs that require grad
        (another model's training output, a leaf with requires_grad=True) get their gradients
        too, as upstream: such a call runs as forward() and loss.backward() instead of the
        fused pass (a Python loss_fn only; see roundpipe/_chained_backward.py).

        Args:
            input_args: positional inputs (a tuple; a single tensor is accepted too).
            input_kwargs: keyword inputs (travel with the first input; the engine's layers
                consume input 0). A causal LM takes ``input_ids``, ``attention_mask`` and
                ``position_ids``, positionally or by keyword.
            label: labels, split like the inputs (see RoundPipeRunConfig.split_label); for a
                causal LM, token ids [batch, seq] shaped like input_ids, -100 for no target
                (token t is scored against label t + 1, as transformers' ``labels=``).
            loss_fn: None or "output" (the output is the loss; for a causal LM given a label,
                None means "causal_lm"), "mse", "cross_entropy", "causal_lm" (the mean token
                cross entropy over the batch's targets, fused into the LM head), a
                BuiltinLoss, or a Python callable ``loss_fn(outputs, labels) -> loss tensor``
                (or a sequence of loss tensors) called once per microbatch, on the device
                where the tail stage ran, with that microbatch's outputs (their pytree, in the
                model dtype) and labels (any pytree, split by the binding, tensors moved to
                that device); the binding back-propagates through it with torch autograd. Exceptions it raises abort the
                call and are re-raised here; the model stays usable and no gradient of the call
                is kept.
            return_outputs: also return the merged outputs (not with "causal_lm", which
                never forms the logits).
            run_config: per-call RoundPipeRunConfig.

        Returns:
            the sum of the microbatch losses (0-d float64 tensor), or (loss, outputs).
        """
        model = self._model
        model.handle  # raises when closed
        if isinstance(input_args, torch.Tensor):
            input_args = (input_args,)
        py = self._run_config.call_fields(run_config)
        tensors, dims, split_call, tree = self._call_inputs(input_args, input_kwargs, py)
        if loss_fn is None and label is not None and self._hf_config is not None:
            loss_fn = "causal_lm"
        builtin = builtin_loss(loss_fn, label, return_outputs)
        engine_label = label if builtin is not None and builtin.kind != "output" else None
        label_dim = builtin_label_dim(py.split_label) if engine_label is not None else None
        with CallScope() as scope, layer_call(self._runtime, self._python_layers, scope, tree,
                                              training=True) as state:
            split = scope.split_callback(split_call)
            config, resolved, merge = self._configs(scope, run_config, py, dims, label_dim,
                                                    split)
            if builtin is not None:
                loss = scope.own(Loss.builtin(LOSSES[builtin.kind], builtin.scale))
            else:  # the binding splits the labels (any pytree) for the Python loss_fn
                labels = None if label is None else \
                    split_label(label, py.split_label, resolved.num_microbatch)
                tail = self._python_layers[-1].index if self._tree_outputs else None
                loss = scope.own(python_loss(scope, self._steps.wrap_loss(loss_fn), labels,
                                             state, tail))
            inputs = BorrowedInputs(tensors)
            labels_in = BorrowedInputs([engine_label]) if engine_label is not None else None
            value, outputs = scope.run(model.forward_backward, inputs,
                                       labels_in.pointers[0] if labels_in else None, loss,
                                       config, return_outputs)
            value = torch.tensor(value, dtype=torch.float64)
            if return_outputs:
                return value, self._outputs(outputs.to_torch(), py, resolved, merge, state)
            return value

    # -- optimizer ----------------------------------------------------------------------------

    def optim_named_parameters(self, prefix="", remove_duplicate=True):
        """(name, Parameter) for every parameter: torch Parameters sharing memory with the
        engine's master weights (fp32 unless optim_dtype says otherwise). Inside a step
        function their .grad is that step's gradient; after synchronize() it is the gradient
        accumulated since the last step; None for a parameter no call reached (as autograd
        leaves it), which torch.optim then skips. Read or write them only inside a step function
        or after synchronize(). Names are "<layer>.<name>" ("0.weight"). A gradient whose engine
        dtype differs from the parameter's (bf16 gradients with ``host_memory="saving"``) is
        given as a copy in the parameter's dtype: a view otherwise."""
        self._model.handle  # raises when closed
        for name, p in self._params.build():
            yield (prefix + "." + name if prefix else name), p

    def optim_parameters(self):
        """The Parameters of optim_named_parameters(), for a torch.optim optimizer."""
        for _, p in self.optim_named_parameters():
            yield p

    # The engine keeps one host copy that Python can reach: the master weights. parameters()
    # gives the same Parameters (upstream redirects them to the optimizer copy inside step_fn).
    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        """Same as optim_named_parameters(): the latest weights after synchronize()."""
        return self.optim_named_parameters(prefix, remove_duplicate)

    def parameters(self, recurse=True):
        return self.optim_parameters()

    def _raise_step_failure(self, failure):
        if failure.status == Status.CALLBACK and self._params.step_exc is not None:
            exc, self._params.step_exc = self._params.step_exc, None
            raise exc
        raise failure

    def step(self, step_fn: Union[Callable[..., Any], BuiltinOptimizer], is_async: bool = True,
             *args: Any, **kwargs: Any) -> None:
        """One optimizer step over the gradients accumulated since the previous one.

        `step_fn` is either a built-in optimizer's settings (roundpipe.optim.AdamW / SGD: the
        update runs in C++), or a Python callable ``step_fn(*args, **kwargs)`` run on the
        optimizer thread with optim_parameters()' .grad set to this step's gradients, e.g.
        ``lambda: (opt.step(), opt.zero_grad())`` for a torch.optim optimizer over
        optim_parameters(); it must update the parameters in place. With
        ``host_memory="saving"`` the gradients of a bf16 / fp16 model are bf16 in the engine
        and .grad is an fp32 copy of them (writes to it do not reach the engine); a built-in
        optimizer is the memory-saving path there (bf16 moments, no copies).

        step_fn runs inside :class:`roundpipe.OptimizerCtx`; a :class:`roundpipe.GradScaler`
        used in it unscales with the scale this step's gradients were made with. Once a
        GradScaler has scaled this model's losses, step() hands inf / nan handling to it for
        good (the engine's ``skip_nonfinite_steps`` and its fp16 loss scaler are switched off
        before the step is queued): every step_fn runs and ``scaler.step(optimizer)`` skips
        ``optimizer.step()`` on an overflow, as upstream documents. Without a GradScaler, a
        step the engine skips (inf / nan gradients: ``skip_nonfinite_steps``, or its fp16 loss
        scaler) does not run step_fn: a warning is logged on the "roundpipe" logger.

        Async (default): returns at once; the next forward_backward runs on the weights from
        before this step (staleness one). An exception raised by an async step_fn is re-raised
        by the next step() or synchronize(). Sync: returns when the new weights are in use, and
        re-raises step_fn's exception itself.
        """
        model = self._model
        model.handle  # raises when closed
        params = self._params
        if params.sync_grads:  # nothing runs since synchronize(): safe to drop its grad views
            params.detach_grads()
            params.sync_grads = False
        try:
            if isinstance(step_fn, BuiltinOptimizer):
                if args or kwargs:
                    raise TypeError("a built-in optimizer takes no step arguments")
                model.step(step_fn, is_async)
                self._steps.settle(latest_done=True)
            elif callable(step_fn):
                handover = self._steps.has_scalers() and not self._steps.handed_over
                if handover and model.step_in_call():
                    handover = False  # the engine refuses this step: change none of its settings
                if handover:  # before the step: this step_fn must run, overflow or not
                    self._hand_nonfinite_steps_to_scalers()
                call = self._steps.begin_step(step_fn, args, kwargs, is_async)
                if handover:  # later losses: the GradScaler scales their gradients too
                    self._steps.handed_over = True
                    self._steps.engine_scaled = False
                key = registry.add(StepCall(params, call, (), {}))
                try:
                    model.step_callback(key, is_async)
                except RoundPipeError:
                    # not enqueued (a sync step that ran popped it already)
                    if registry.pop(key) is not None:
                        self._steps.cancel(call)
                    raise
                self._steps.settle(latest_done=not is_async)  # earlier steps have finished
            else:
                raise TypeError("step_fn must be a callable or a roundpipe.optim optimizer")
            return
        except RoundPipeError as err:
            failure = err
        self._raise_step_failure(failure)

    def set_grad_scaler(self, initial_scale: float, growth_interval: int = 2000) -> None:
        """Switch the engine's dynamic loss scaling (the constructor's ``grad_scaler``) on this
        live model: ``initial_scale`` > 0 (re)starts it with that scale, 0 turns it off. Steps
        already queued finish first with the old setting. A :class:`roundpipe.GradScaler`
        turns it off by itself (see :meth:`step`)."""
        self._model.call("model_set_grad_scaler", float(initial_scale), int(growth_interval))
        if not self._steps.handed_over:
            self._steps.engine_scaled = float(initial_scale) > 0

    def set_skip_nonfinite_steps(self, skip: bool) -> None:
        """Skip (True, the default at construction) or run (False) a step whose gradients
        hold inf or nan, from the next step on (the queued ones finish first)."""
        self._model.call("model_set_skip_nonfinite_steps", int(bool(skip)))

    def set_step_in_call(self, optimizer: Optional[BuiltinOptimizer]) -> None:
        """Step inside the training calls (``host_memory="saving"`` only;
        ``rp_model_set_step_in_call``). With a built-in optimizer's settings
        (roundpipe.optim.AdamW / SGD), every later forward_backward is also the optimizer step
        over its own gradients: it leaves the weights forward_backward followed by
        ``step(optimizer, is_async=False)`` would, bit for bit, but each parameter is updated on
        the optimizer thread as soon as its gradient is final, so the step hides behind the
        backward. The settings are copied: a later change to `optimizer` counts once it is
        passed here again. ``None`` switches back to explicit steps.

        While on, one call is one step (no accumulation over calls), :meth:`step` raises
        RoundPipeError (``Status.STATE``), a parameter without a gradient in the call is left
        alone, and one whose gradient holds inf or nan too (the step is counted as skipped,
        :meth:`nonfinite_counts`, unless ``set_skip_nonfinite_steps(False)``). A call that fails
        in its backward keeps the updates already made and drops the other gradients. No
        ``step_fn`` runs, so a :class:`roundpipe.GradScaler` cannot unscale these steps.

        Raises TypeError, with nothing changed, when `optimizer` is neither None nor a built-in
        optimizer; RoundPipeError (``Status.STATE``), with nothing changed, for a model in the
        standard host memory mode, with the engine's loss scaler, holding optimizer state of
        another kind, or holding gradients accumulated since its last step (:meth:`step` or
        :meth:`zero_grad` first). With data parallelism each rank updates from the gradients
        averaged over the ranks."""
        if optimizer is not None and not isinstance(optimizer, BuiltinOptimizer):
            raise TypeError("set_step_in_call takes a roundpipe.optim built-in optimizer "
                            "(AdamW, SGD) or None, not %s" % type(optimizer).__name__)
        self._model.set_step_in_call(optimizer)

    def _hand_nonfinite_steps_to_scalers(self) -> None:
        """A roundpipe.GradScaler serves this model's steps: from now on the engine neither
        scales losses nor skips steps for inf / nan gradients, so every step_fn runs and
        GradScaler.step() decides whether optimizer.step() runs, as upstream documents."""
        model = self._model
        model.call("model_set_skip_nonfinite_steps", 0)
        if self._steps.engine_scaled:
            model.call("model_set_grad_scaler", 0.0, 1)
            logger.info("%s: a GradScaler serves this model: the engine's loss scaler is off "
                        "from now on (the GradScaler scales)", self._name)

    def synchronize(self):
        """Wait for every pending step and publish the latest weights. Afterwards the
        parameters show the latest master weights and their .grad the gradients accumulated
        since the last step, and so does the nn.Module the model was built from (weights,
        buffers such as BatchNorm running statistics, and .grad of trainable parameters), as
        upstream's synchronize() leaves it (for a PEFT model: its adapters, so that PEFT's
        own save_pretrained writes the trained ones). Frozen parameters are copied only when
        a load or the data-parallel broadcast may have changed them. Re-raises the exception
        of a failed async step_fn."""
        self._sync_engine()
        if self.model is not None and self._module_names:
            frozen = self._module_frozen_stale or self.world_size > 1
            copy_into_module(self._model.handle.value, self.model, self._module_names,
                             frozen=frozen)
            self._module_frozen_stale = False

    def _sync_engine(self):
        model = self._model
        failure = None
        try:
            model.call("synchronize")
        except RoundPipeError as err:
            failure = err
        self._steps.settle(latest_done=True)
        if failure is not None:
            self._raise_step_failure(failure)
        self._params.attach_grads(model.handle.value)
        self._params.sync_grads = True

    def zero_grad(self, set_to_none=True):
        """Drop the gradients accumulated since the last step."""
        self._model.call("zero_grad")
        self._params.reattach_grads(self._model.handle.value)


def spec_json(model):
    """The JSON layer spec RoundPipe(model) would build (for inspection). Hugging Face models
    are built by the engine from their config (docs/semantics.md has the layer list)."""
    source = resolve_model(model)
    if source.is_hf:
        raise RoundPipeUnsupportedError("a Hugging Face model is built by the engine from its "
                                        "config.json; it has no JSON layer spec here")
    return json.loads(source.text)
