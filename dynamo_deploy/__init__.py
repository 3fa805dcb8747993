"""Scale-out on NVIDIA Dynamo: encoder and decoder workers, hand-over between them, session affinity."""
