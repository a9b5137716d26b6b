"""The per-compilation record the passes read and fill in."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx

from ..declare.plan import Plan
from ..recipes.base import Recipe


@dataclass(frozen=True)
class NMTarget:
    node: fx.Node  # the weight placeholder
    fqn: str  # parameter name relative to the compiled root
    recipe: Recipe
    dim: int  # reduction dimension the consumers group along
    owner: object  # dynamo source of the owning module
    param_name: str  # attribute of the parameter on its module
    origin: str  # which declaration route chose the recipe
    frame: int | None = None  # schedule frame to compile (framed recipes)


@dataclass
class DeployTarget:
    node: fx.Node  # the weight placeholder
    fqn: str
    param: object  # the finalized nn.Parameter
    bias: object  # the bias nn.Parameter of its first linear call, or None (timing only)
    uses: list[fx.Node]  # the F.linear nodes it is the weight of
    decision: object  # nmcompile.kernels.dispatch.Decision
    transposed: bool = False  # the weight is [in, out]: the kernels take its transpose


@dataclass
class PassContext:
    options_plan: Plan | None = None
    env_plan: Plan | None = None
    targets: list[NMTarget] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    by_default: dict[str, str] = field(default_factory=dict)  # heads and routers a catch-all rule left dense
    candidates: list[str] = field(default_factory=list)  # every weight consumed by a GEMM/conv
    weights: list[str] = field(default_factory=list)  # every parameter of 2 or more dims in the graph
    declared: bool = False  # whether any route declared a recipe (even "dense") for some weight
    # (record, reason) of each annotated weight in ctx.skipped (the backend marks them named)
    named: list[tuple[object, str]] = field(default_factory=list)
    # fqn -> (forward weight node, DGRAD weight node or None, the model's nodes that consume it)
    projected: dict[str, tuple[fx.Node, fx.Node | None, tuple[fx.Node, ...]]] = field(default_factory=dict)
    # fqn -> the recipe state placeholders, in the recipe's state_names order
    state_nodes: dict[str, tuple[fx.Node, ...]] = field(default_factory=dict)
    # training GEMM kernels: the option, and per weight the decision (a kernels.dispatch.train.TrainKernels)
    train_kernel: str = "auto"  # auto, dense, cusparselt, cutlass or reference
    train_kernels: dict[str, object] = field(default_factory=dict)
    extra_outputs: int = 0  # graph outputs appended after Dynamo's (saved DGRAD weights), dropped at run time
    # deploy: finalized weights and the kernel each gets
    deploy_kernel: str = "auto"  # auto, dense, cusparselt or reference
    cuda_graphs: bool = False  # the compile runs under CUDA graphs: the GPU kernels are timed by GPU time alone
    deployed: list[DeployTarget] = field(default_factory=list)
    # fqn -> (values, meta): each sparse weight compressed by the deploy rewrite (extra graph inputs)
    compressed: dict[str, tuple] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.declared = self.declared or self.options_plan is not None or self.env_plan is not None
