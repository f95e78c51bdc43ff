"""`pipeline=p`: compute-gradients cut into p stages on p sub-meshes, run micro-batch by micro-batch
in a static schedule (Rhino §5-6), then apply-gradients on the stages, each optimizer op beside
the parameters it updates.

The step is split at its sums as for micro-batching (`several_programs.split_step`); the stager places
the forward ops of compute-gradients (balanced FLOPs, least bytes cut), the backward ops follow
(`hlo_passes.stages`), and each stage's forward and backward program is planned by the SPMD search
on its sub-mesh (the mesh cut along its first axis). apply-gradients' ops go where the bytes they
read are (`stages.assign_apply`): a layer's update on the stage of its parameters and gradient sums,
a global norm's total on one stage. Its programs, one per stage and wave (the stage changes before
them), are planned on their sub-meshes with their arguments pinned to the layouts the stage's
forward and backward programs hold them in, and a result the training loop feeds back tied to its
argument. So parameters and optimizer state live on their stage: the step takes and returns them
there (`plan.input_shardings`), and per step only the batch and what crosses stages moves. Each
tensor one stage hands another moves by cross-mesh resharding (`runtime.resharding`, after "On
Optimizing the Communication of Model Parallelism"), planned once and priced: a micro-batch's
transfers across the busiest boundary are the schedule's transfer time; the arguments a program
reads from elsewhere, and the sums and values apply-gradients' programs take from other stages, once
per step. A stage's memory counts the micro-batches it holds in flight, its running sums and its
optimizer state; over `memory_limit_bytes`, its programs are planned again under what is left. The
executor walks the task graph (`runtime.task_graph`) and dispatches each program with its inputs put
on its sub-mesh (jax's asynchronous dispatch overlaps the stages); between processes, moves are SPMD
programs (`runtime.transfer`). The sums of each micro-batch are added on the stage that makes them.
Not yet: a loop cut across stages.

Interlaced (`op_assign(where, stage="all")`, nnScaler §4.2): the stager also places ops before,
between and after the stages on every device; a micro-batch then passes through a chain of
places, the stages and those, each planned, moved between and scheduled as a stage is, the
latter on the whole mesh, their tasks interlaced with the stages' (`schedules.interlace`).

Multi-forward (nnScaler's 3F1B, `search.multi_forward`): a step that runs its layers R times per
micro-batch, the earlier passes under stop_gradient, has a chain of R·p places, pass r on stage s
being place r·p + s on stage s's sub-mesh; the places of one stage are one home for
apply-gradients and for memory, and only the last pass's places have a backward program.
"""
from .executor import PipelinedCompiled
from .lowered import PipelinedLowered
from .staging import sub_meshes

__all__ = ["PipelinedCompiled", "PipelinedLowered", "sub_meshes"]
