"""Online pCTR: the aiohttp app, the model registry and hot swap, the retrain
trigger. Built by the serving issue; it will load models with
`trainer.bundle.ModelBundle`, the same code that trains them."""
