"""What a run tells the world: Prometheus/TensorBoard metrics, RLJob status, the FLOPs behind MFU."""
