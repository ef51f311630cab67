"""torch.compile support: ``opaque`` (what Dynamo and AOTAutograd need from shardwise: opaque
layout conversions, layouts packed as primitives, meshes as opaque references, eager-only
hooks) and ``schedule`` (a compiled graph's collectives: bucketing, issue early / wait late).
"""
