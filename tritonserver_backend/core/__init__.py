"""The serving core: text, encoder, router, decoder services, scheduler, pipeline, session store, drafting."""
