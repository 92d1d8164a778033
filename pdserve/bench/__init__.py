"""`pdserve bench`: a load generator against the gateway (gRPC or OpenAI HTTP) that starts its
own baselines (naive transformers server, colocated gateway, disaggregated stack) and reports
them side by side. Kept free of heavy imports: the CLI imports the modules when it runs."""
