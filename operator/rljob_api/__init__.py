"""The RLJob API: pydantic models that are the single source for the CRD schema,
operator validation and worker configuration. Depends on pydantic only."""
