"""`forge engine` one step at a time: `engine_builder` runs spec -> checkpoint (`checkpoint`,
`convert`) -> engine directory (`engine_files`, `naive`, `lora`, `speculative`, `manifest`),
put in place by `install`; `build_key` says whether it is out of date, `progress` times the
long loops."""
