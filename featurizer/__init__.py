"""Media to dense features: the image CNN featurizer and the speech front end
(torch only, no sockets). Built by the featurizer issue."""
