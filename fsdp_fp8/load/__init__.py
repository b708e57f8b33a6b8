"""The sharded load path: plan a meta-device model against a checkpoint, agree across ranks,
swap FP8 linears, fully_shard, materialize and read each rank's rows; gather back."""
