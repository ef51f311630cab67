"""Tensor parallelism: a module's weights split over a mesh axis, as parallel styles.

``style`` (ColwiseParallel, RowwiseParallel, SequenceParallel), ``prepare`` (PrepareModuleInput /
Output: layouts at a module's boundary), ``parallelize`` (parallelize_module: a plan of styles
applied by module path), ``loss`` (loss_parallel: cross-entropy over a class-sharded output) and
``heads`` (pure: refuse a split that would cut an attention head).
"""
