"""Data-parallel serving: engine replicas as Ray actors behind one router (routing.py: the
policies and the exact per-replica KV index; replica.py: the Ray actor; client.py: the
server's engine client over the replicas; sim.py: the same routing over model-free
replicas at scale)."""
