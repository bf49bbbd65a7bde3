"""Training recipes: MARS proposer, verifier, diffusion drafter, survival predictors."""

MASK_TOKEN = "<|mask|>"  # the MARS placeholder a proposer learns; its id goes to config.json as `mask_token_id`
