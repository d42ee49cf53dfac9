mod datasets;
mod download;
mod env;
mod errors;
mod fake_hub;
mod model_card;
mod push;
mod support;
