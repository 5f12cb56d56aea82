use burn_parallel_models::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Tp(#[from] burn_parallel_tp::TpError),
    #[error(transparent)]
    Fsdp(#[from] burn_parallel_fsdp::FsdpError),
    #[error(transparent)]
    Collective(#[from] burn_parallel_comm::CollectiveError),
    #[error(transparent)]
    Mesh(#[from] burn_parallel_comm::MeshError),
    #[error(transparent)]
    Parallel(#[from] burn_parallel_parallelizer::ParallelError),
    #[error(transparent)]
    Checkpoint(#[from] burn_parallel_checkpoint::CheckpointError),
    #[error("training failed: {0}")]
    Ranks(String),
}
