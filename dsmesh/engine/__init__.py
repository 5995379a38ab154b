"""dsmesh inference engine: model, sampling, quantisation."""
